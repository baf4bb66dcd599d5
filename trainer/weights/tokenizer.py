"""The tokenizer that goes with weights: one resolver for every entry point that loads weights
(training's `--from_weight`, chat, eval, export in every format, inspect_data's `--from_weight`).

Weights name their own tokenizer in one of these ways (`OwnTokenizer`):
- an HF directory (a run's `model/`, an export) holds its files;
- a resume checkpoint holds a copy of its run's tokenizer (the `tokenizer` entry: the files and their
  fingerprint, `checkpoint_record`), so the tokenizer a checkpoint names is its run's, also when the run
  used the shipped `model/tokenizer` and that has changed since;
- a checkpoint without that copy names a directory (`args["tokenizer_path"]`, None: the shipped one)
  and the fingerprint its run trained with (its run-identity record); the directory's tokenizer must
  still have that fingerprint.
A tokenizer given explicitly (`--tokenizer_path`) must be the weights' own: compared by fingerprint
(vocabulary, special tokens, chat template) with the one the weights recorded, another one is refused
in one line.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from dataset import DataError, load_tokenizer
from dataset.rendering import holds_tokenizer, tokenizer_fingerprint
from trainer.errors import CheckpointError, ConfigError

SHIPPED = "the shipped model/tokenizer"
IDENTITY_KEY = "--tokenizer_path (tokenizer and chat template)"  # in the oldest checkpoints' sample_stream["fixed"]


@dataclass(frozen=True)
class OwnTokenizer:
    """The tokenizer weights were trained with, as far as they say."""

    how: str  # "saved with the weights" | "recorded by the resume checkpoint's run"
    directory: str | None = None  # where its files are (a checkpoint's None: the shipped model/tokenizer)
    files: dict | None = None  # its files (name -> text), as a resume checkpoint keeps them
    fingerprint: str | None = None  # the fingerprint (or its leading characters) the checkpoint recorded

    def name(self) -> str:
        return self.directory or SHIPPED

    def where(self) -> str:
        return f"the checkpoint's copy of {self.name()}" if self.files else self.name()


def checkpoint_record(tokenizer) -> dict:
    """The `tokenizer` entry of a resume checkpoint: the run's tokenizer files and their fingerprint."""
    with tempfile.TemporaryDirectory(prefix="minisft-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        files = {}
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                files[name] = handle.read()
    return {"fingerprint": tokenizer_fingerprint(tokenizer), "files": files}


def of_checkpoint(saved: dict) -> OwnTokenizer:
    """The tokenizer a loaded resume checkpoint (or a sharded one's meta) names."""
    args = saved.get("args") if isinstance(saved.get("args"), dict) else {}
    record = saved.get("tokenizer") if isinstance(saved.get("tokenizer"), dict) else {}
    files = record.get("files") if isinstance(record.get("files"), dict) else None
    return OwnTokenizer("recorded by the resume checkpoint's run", args.get("tokenizer_path"), files,
                        record.get("fingerprint") or _identity_fingerprint(saved.get("sample_stream")))


def _identity_fingerprint(stream) -> str | None:
    if not isinstance(stream, dict):
        return None
    identity, fixed = stream.get("identity"), stream.get("fixed")
    if isinstance(identity, dict) and isinstance(identity.get("tokenizer"), str):
        return identity["tokenizer"]
    if isinstance(fixed, dict) and isinstance(fixed.get(IDENTITY_KEY), str):
        return fixed[IDENTITY_KEY]
    return None


def of_folder(folder: str) -> OwnTokenizer | None:
    """The tokenizer saved in a weights folder (an HF directory, the folder of a .safetensors), or None."""
    if holds_tokenizer(folder):
        return OwnTokenizer("saved with the weights", folder)
    return None


def matches(tokenizer, fingerprint: str) -> bool:
    return tokenizer_fingerprint(tokenizer)[:len(fingerprint)] == fingerprint


def load_own(own: OwnTokenizer, source: str):
    """The weights' own tokenizer, checked against the fingerprint they recorded; one line if it cannot be."""
    if own.files:
        with tempfile.TemporaryDirectory(prefix="minisft-tokenizer-") as folder:
            for name, text in own.files.items():
                with open(os.path.join(folder, os.path.basename(name)), "w", encoding="utf-8") as handle:
                    handle.write(text)
            tokenizer = load_tokenizer(folder)
        if own.fingerprint and not matches(tokenizer, own.fingerprint):
            raise CheckpointError(f"{source}: the copy of its run's tokenizer does not have the fingerprint it "
                                  "recorded (a damaged checkpoint); give --tokenizer_path DIR (the run's tokenizer)")
        return tokenizer
    if own.directory and not os.path.isdir(own.directory):
        raise ConfigError(f"{source}: the tokenizer its run recorded, {own.directory}, is gone; give "
                          "--tokenizer_path DIR (that tokenizer or a copy of it)")
    tokenizer = load_tokenizer(own.directory)
    if own.fingerprint and not matches(tokenizer, own.fingerprint):
        raise ConfigError(f"{source}: the tokenizer its run recorded ({own.name()}) has changed since (fingerprint "
                          f"{own.fingerprint[:16]} recorded, {tokenizer_fingerprint(tokenizer)[:16]} now); give "
                          "--tokenizer_path DIR with the tokenizer the run trained with")
    return tokenizer


def check_explicit(tokenizer, path: str, own: OwnTokenizer, source: str) -> str | None:
    """Refuse an explicit tokenizer that is not the weights' own; a note when it could be checked only by
    the fingerprint the weights recorded (their tokenizer's files are gone), else None."""
    try:
        theirs = load_own(own, source)
    except (ConfigError, CheckpointError, DataError):
        if own.fingerprint is None:
            return f"warning: the tokenizer {own.how} ({own.name()}) cannot be loaded: --tokenizer_path {path} is used unchecked"
        if matches(tokenizer, own.fingerprint):
            return (f"note: the tokenizer {own.how} ({own.name()}) is not at hand: --tokenizer_path {path} has "
                    "the fingerprint it recorded")
        raise ConfigError(f"--tokenizer_path {path} is not the tokenizer {own.how} (fingerprint {own.fingerprint[:16]}, "
                          f"this one {tokenizer_fingerprint(tokenizer)[:16]}); give the tokenizer the weights were "
                          "trained with") from None
    if tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(theirs):
        what = ("another vocabulary" if tokenizer.get_vocab() != theirs.get_vocab()
                else "another chat template or other special tokens")
        raise ConfigError(f"--tokenizer_path {path} has {what} than the tokenizer {own.how} ({own.name()}); "
                          "leave --tokenizer_path out to use that one")
    return None


def check_vocab_fits(tokenizer, vocab_size: int, own: OwnTokenizer | None, source: str) -> None:
    """Every token id must have an embedding; a vocab_size above the tokenizer's size (padded) is taken only
    with the weights' own tokenizer (or one with its fingerprint): a tokenizer of weights that name none
    must have their size exactly, else it is another one, whose ids mean other text."""
    if len(tokenizer) > vocab_size or (len(tokenizer) != vocab_size and own is None):
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the weights' vocab_size is {vocab_size} "
                          f"({source}): use the tokenizer the weights were trained with")


def resolve_tokenizer(own: OwnTokenizer | None, explicit: str | None, source: str, log=print):
    """(tokenizer, the directory to record for it, where it came from): `explicit` (checked against the
    weights' own), else the weights' own, else the shipped one."""
    if explicit:
        tokenizer = load_tokenizer(explicit)
        note = check_explicit(tokenizer, explicit, own, source) if own is not None else None
        if note:
            log(note)
        return tokenizer, explicit, "--tokenizer_path"
    if own is None:
        return load_tokenizer(None), None, "the shipped default"
    return load_own(own, source), own.directory, own.how
