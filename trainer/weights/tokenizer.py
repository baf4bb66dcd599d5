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
A tokenizer given explicitly (`--tokenizer_path`) must be the weights' own, by one rule for every entry
point (`compare_with_own`, inspect_data's too): the same `definition_fingerprint` as their own tokenizer,
or, where its files are gone or hold another tokenizer, the fingerprint the weights recorded; another
one is refused in one line (inspect_data shows what differs).

A folder minisft writes (`model/`, `best/`, an export) records its tokenizer's `definition_fingerprint`
in `RECORD_FILE`, so tokenizer files copied over it afterwards are refused, not read as the weights'
own; a folder without that file (older runs, other tools, the hub) is taken as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass

from dataset import DataError, load_tokenizer
from dataset.rendering import holds_tokenizer, tokenizer_fingerprint
from trainer.errors import CheckpointError, ConfigError

SHIPPED = "the shipped model/tokenizer"
SAVED = "saved with the weights"
TOKENIZATION = "tokenization (merges, normalizer, pre-tokenizer or added tokens)"
RECORD_FILE = "minisft_tokenizer.json"  # in a weights folder: the fingerprint of the tokenizer the weights go with
IDENTITY_KEY = "--tokenizer_path (tokenizer and chat template)"  # in the oldest checkpoints' sample_stream["fixed"]


@dataclass(frozen=True)
class OwnTokenizer:
    """The tokenizer weights were trained with, as far as they say."""

    how: str  # SAVED | "recorded by the resume checkpoint's run"
    directory: str | None = None  # where its files are (a checkpoint's None: the shipped model/tokenizer)
    files: dict | None = None  # its files (name -> text), as a resume checkpoint keeps them
    fingerprint: str | None = None  # the fingerprint (or its leading characters) the weights recorded
    record: str | None = None  # the folder's RECORD_FILE: `fingerprint` is then a `definition_fingerprint`

    def fingerprint_of(self, tokenizer) -> str:
        """`tokenizer`'s fingerprint in the form `fingerprint` was recorded in."""
        return definition_fingerprint(tokenizer) if self.record else tokenizer_fingerprint(tokenizer)

    def matches(self, tokenizer) -> bool:
        return self.fingerprint_of(tokenizer)[:len(self.fingerprint)] == self.fingerprint

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


def definition_fingerprint(tokenizer) -> str:
    """sha256 of what gives the token ids and the text they stand for, in a form no transformers or
    tokenizers version changes: the backend's definition (vocabulary, merges, added and special tokens,
    normalizer, pre-tokenizer, post-processor, decoder) as canonical JSON, the chat template and the
    bos / eos / pad tokens. Not `tokenizer_fingerprint`, which hashes the class name (transformers 4's
    PreTrainedTokenizerFast is 5's TokenizersBackend), so a folder written under one would be refused
    under the other. Not the files' bytes either: the same tokenizer saved again (by transformers 4,
    another tokenizers version, with another model_max_length) means the same ids and is accepted;
    another vocabulary or chat template is not. Merges are taken as pairs (tokenizers before 0.20 wrote
    "a b"), and a setting that is null or false counts as absent: a tokenizers version that adds a
    setting writes it with its neutral value (ignore_merges: false)."""
    text = json.dumps(_definition(tokenizer), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _definition(tokenizer) -> dict:
    """What `definition_fingerprint` hashes: {"backend", "chat_template", "specials"}."""
    definition = json.loads(tokenizer.backend_tokenizer.to_str())
    for runtime in ("version", "truncation", "padding"):  # how a call pads or cuts, not what the ids mean
        definition.pop(runtime, None)
    model = definition.get("model") or {}
    if isinstance(model.get("merges"), list):
        model["merges"] = [merge.split(" ", 1) if isinstance(merge, str) else merge for merge in model["merges"]]
    specials = {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token")}
    return {"backend": _settings(definition), "chat_template": tokenizer.chat_template,
            "specials": {name: str(token) for name, token in specials.items() if token is not None}}


def _settings(value):
    """`value` with every dict's null and false entries left out, at any depth."""
    if isinstance(value, dict):
        return {key: _settings(item) for key, item in value.items() if item is not None and item is not False}
    if isinstance(value, list):
        return [_settings(item) for item in value]
    return value


def folder_record(tokenizer) -> str:
    """The text of a weights folder's RECORD_FILE for `tokenizer`, the one the weights go with."""
    record = {"tokenizer_fingerprint": definition_fingerprint(tokenizer),
              "about": "minisft refuses this folder when its tokenizer files hold another tokenizer than the one "
                       "its weights were trained with (this fingerprint); delete this file to use other ones"}
    return json.dumps(record, indent=2) + "\n"


def of_folder(folder: str, record: dict | None = None) -> OwnTokenizer | None:
    """The tokenizer saved in a weights folder (an HF directory, the folder of a .safetensors), or None;
    `record`: its RECORD_FILE as read (trainer/weights/read.py: `folder_tokenizer`), None where it has none."""
    if record is not None:
        path = os.path.join(folder, RECORD_FILE)
        fingerprint = record.get("tokenizer_fingerprint")
        if not isinstance(fingerprint, str) or not re.fullmatch(r"[0-9a-f]{64}", fingerprint):
            raise CheckpointError(f"{path}: no tokenizer_fingerprint (64 hex digits) in it: not a record minisft "
                                  "wrote; delete it to use the folder's tokenizer unchecked")
        return OwnTokenizer(SAVED, folder, fingerprint=fingerprint, record=path)
    if holds_tokenizer(folder):
        return OwnTokenizer(SAVED, folder)
    return None


@dataclass(frozen=True)
class Trouble:
    """Why the weights' own tokenizer does not load as they recorded it."""

    fact: str  # what is true of its files, naming them
    advice: str  # what to give instead
    error: type = ConfigError


def _load_as_recorded(own: OwnTokenizer):
    """(the weights' own tokenizer, None), or (None, the `Trouble` with its files); a `DataError` where its
    files cannot be read as a tokenizer."""
    if own.files:
        with tempfile.TemporaryDirectory(prefix="minisft-tokenizer-") as folder:
            for name, text in own.files.items():
                with open(os.path.join(folder, os.path.basename(name)), "w", encoding="utf-8") as handle:
                    handle.write(text)
            tokenizer = load_tokenizer(folder)
        if own.fingerprint and not own.matches(tokenizer):
            return None, Trouble("the copy of its run's tokenizer does not have the fingerprint it recorded (a damaged "
                                 "checkpoint)", "give --tokenizer_path DIR (the run's tokenizer)", CheckpointError)
        return tokenizer, None
    if own.directory and not os.path.isdir(own.directory):
        return None, Trouble(f"the tokenizer its run recorded, {own.directory}, is gone",
                             "give --tokenizer_path DIR (that tokenizer or a copy of it)")
    if own.record and not holds_tokenizer(own.directory):
        return None, Trouble(f"the tokenizer files saved with the weights are gone from {own.directory} "
                             f"({own.record} records their fingerprint)",
                             "give --tokenizer_path DIR with the tokenizer the weights were trained with")
    tokenizer = load_tokenizer(own.directory)
    if own.fingerprint and not own.matches(tokenizer):
        now = own.fingerprint_of(tokenizer)[:16]
        if own.record:
            return None, Trouble(f"the tokenizer files in {own.directory} hold another tokenizer than the weights "
                                 f"were saved with (fingerprint {own.fingerprint[:16]} in {RECORD_FILE}, {now} in "
                                 "its files)",
                                 "give --tokenizer_path DIR with the tokenizer the weights were trained with, or, if "
                                 f"these files are meant for the weights, delete {own.record}")
        return None, Trouble(f"the tokenizer its run recorded ({own.name()}) has changed since (fingerprint "
                             f"{own.fingerprint[:16]} recorded, {now} now)",
                             "give --tokenizer_path DIR with the tokenizer the run trained with")
    return tokenizer, None


def load_own(own: OwnTokenizer, source: str):
    """The weights' own tokenizer, checked against the fingerprint they recorded; one line if it cannot be."""
    tokenizer, trouble = _load_as_recorded(own)
    if trouble:
        raise trouble.error(f"{source}: {trouble.fact}; {trouble.advice}")
    return tokenizer


@dataclass(frozen=True)
class Comparison:
    """A tokenizer against the weights' own (`compare_with_own`)."""

    same: bool | None  # it is their own; None: cannot be told (no fingerprint recorded, their own does not load)
    theirs: object = None  # their own tokenizer, where it loads as they recorded it
    trouble: str | None = None  # where it does not: "SOURCE: what is true of its files" (gone, replaced, unreadable)

    def note(self, path: str) -> str | None:
        """The line that says what is true of the weights' own tokenizer where it does not load, None where it does."""
        if self.trouble is None:
            return None
        if self.same is None:
            return f"warning: {self.trouble}; --tokenizer_path {path} is used unchecked"
        if self.same:
            return f"note: {self.trouble}; --tokenizer_path {path} has the fingerprint the weights recorded"
        return f"note: {self.trouble}"


def compare_with_own(tokenizer, own: OwnTokenizer, source: str) -> Comparison:
    """Whether `tokenizer` is the weights' own, the one rule of every entry point: where their own loads as
    they recorded it, the same `definition_fingerprint` (the same ids and text, however the files are
    written and whichever class reads them); where it does not (its files gone, replaced by another
    tokenizer's, changed since, unreadable), the fingerprint the weights recorded (a folder's RECORD_FILE,
    a checkpoint's), so a tokenizer with that fingerprint stands in for the files."""
    try:
        theirs, trouble = _load_as_recorded(own)
        trouble = trouble and f"{source}: {trouble.fact}"
    except DataError as error:
        theirs, trouble = None, f"{source}: {error}"
    if theirs is not None:
        return Comparison(definition_fingerprint(tokenizer) == definition_fingerprint(theirs), theirs)
    return Comparison(own.matches(tokenizer) if own.fingerprint else None, trouble=trouble)


def tokenizer_differences(tokenizer, reference) -> list[str]:
    """What differs between `tokenizer` and `reference` (the weights' own) in what `definition_fingerprint`
    covers: vocabulary, tokenization, chat template, bos / eos / pad tokens; empty where nothing does."""
    mine, theirs = _definition(tokenizer), _definition(reference)
    differences = []
    vocab, other = tokenizer.get_vocab(), reference.get_vocab()
    if vocab != other:
        moved = sum(1 for token, index in vocab.items() if other.get(token) != index)
        differences.append(f"vocabulary ({len(vocab)} tokens against {len(other)}; {moved} tokens have another id "
                           "or are missing)")
    elif mine["backend"] != theirs["backend"]:
        differences.append(TOKENIZATION)
    if mine["chat_template"] != theirs["chat_template"]:
        differences.append("chat template" + _first_difference(str(tokenizer.chat_template),
                                                                 str(reference.chat_template)))
    for name in ("bos_token", "eos_token", "pad_token"):
        if mine["specials"].get(name) != theirs["specials"].get(name):
            differences.append(f"{name} ({getattr(tokenizer, name, None)!r} against {getattr(reference, name, None)!r})")
    return differences


def _first_difference(mine: str, theirs: str) -> str:
    for number, (a, b) in enumerate(zip(mine.splitlines(), theirs.splitlines()), start=1):
        if a != b:
            return f" (first at line {number}: {a.strip()[:60]!r} against {b.strip()[:60]!r})"
    return f" ({len(mine.splitlines())} lines against {len(theirs.splitlines())})"


def check_explicit(tokenizer, path: str, own: OwnTokenizer, source: str) -> str | None:
    """Refuse an explicit tokenizer that is not the weights' own (`compare_with_own`); the line that says what
    is true of their own tokenizer's files where it does not load, else None."""
    comparison = compare_with_own(tokenizer, own, source)
    if comparison.same is False and comparison.theirs is None:
        raise ConfigError(f"--tokenizer_path {path} is not the tokenizer {own.how} (fingerprint {own.fingerprint[:16]}, "
                          f"this one {own.fingerprint_of(tokenizer)[:16]}); give the tokenizer the weights were "
                          "trained with")
    if comparison.same is False:
        first = tokenizer_differences(tokenizer, comparison.theirs)[0]
        what = ("another vocabulary" if first.startswith("vocabulary") else f"another {TOKENIZATION}"
                if first == TOKENIZATION else "another chat template or other special tokens")
        raise ConfigError(f"--tokenizer_path {path} has {what} than the tokenizer {own.how} ({own.name()}); "
                          "leave --tokenizer_path out to use that one")
    return comparison.note(path)


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
