"""What decides which samples a run trains on and in which order, computed once at start-up from the
data the run actually loaded, stored in every resume checkpoint and compared when resuming.

A checkpoint's position ("N samples of epoch E consumed") only means something in the sample stream
that these define, so a resume that changes one is refused with one line naming it:
- the seed, `--max_seq_len` and `--packing`; with `--packing 1`, whether rows hold room for a system
  prompt (`--system_prompt_ratio` above 0: dataset/packing.py plans rows with it);
- every training source: its files in order, each with the sha256 of its content (the token cache's
  digest, taken when the cache was opened), its number of samples and the digest of its samples
  (`samples_digest` of its cache's meta.json: which rows became samples), and the source's weight as an
  exact fraction of the total (`1,1` and `0.5,0.5` are the same mixture, `1,1.000004` is not). Files
  are compared by content, not by path: the record keeps each path to name it, and a byte-identical
  file at another path resumes;
- the tokenizer and chat template (their fingerprint), and the version of the code that turns rows
  into tokens (dataset.cache.key.TOKENS_VERSION).
The version of the rules that decide which rows are bad (dataset.cache.key.ROWS_VERSION) is not
part of it: code of other rules builds the token caches again, and a resume is refused only where a
file's samples differ (their number, or their digest where both records hold one), so one whose rows
are the same resumes. A cache that records no digest of its samples is compared by their number: it
is not built again for the record (its rows change only with a rules version, whose new cache key
builds a cache that records one).
`save()` never reads the data files again: a file that is moved, deleted or grown while the run
trains changes nothing in its checkpoints, and a resume over the changed data is refused.

The epoch's length grouping (`epoch_grouping`: `--group_by_length` and the global batch) may change
on resume: the interrupted epoch is finished in the order the checkpoint's run used (the sampler pins
it), later epochs use the new settings. No sample of the epoch is seen twice or never.

A version 1 record, `sample_stream["fixed"]` (no version key), holds the same facts in another form
(a checkpoint without a `sample_stream` holds only its flags); `legacy_fixed` gives this run's facts in
that form to compare them with. Their tokenizing code recorded no version: it is version 1
(`TOKENS_CHANGES[1]`), and a resume by code of another version is refused like any other difference.

Every change of the record's shape has its own `RECORD_VERSION`, and every shape is read:
- 2: `identity` without `tokens_version` (the tokenizing code of version 1) or without the sources'
  `left_out`;
- 3: `identity` without `prompt_room` (rows without room for a system prompt);
- 4: files without `samples_digest` (compared by their number of samples);
- 5: `identity` without `room_rule` (rows with room planned by `dataset.augment.ROOM_RULE` 1);
- 6: every field of `RunIdentity`.
A record that cannot be read (a newer version, a missing or mistyped field) is a one-line refusal.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

from dataset.augment import ROOM_RULE
from dataset.rendering import tokenizer_fingerprint
from dataset.cache import TOKENS_VERSION
from trainer.checkpoint.save_dir import MODEL_DIR

RECORD_VERSION = 6
UNRECORDED_TOKENS_VERSION = 1  # the tokenizing code of the checkpoints that recorded none


@dataclass(frozen=True)
class SourceFile:
    path: str
    digest: str  # sha256 of the file's content
    samples: int  # after bad lines skipped and samples without loss tokens dropped
    samples_digest: str | None  # which samples (the cache's `samples_digest`); None: its cache records none


@dataclass(frozen=True)
class SourceRecord:
    spec: str  # as given in --data_path (without the weight)
    weight: float  # as given
    share: str  # the weight's exact fraction of all weights ("1/2"); one source: "1"
    files: tuple[SourceFile, ...]
    left_out: tuple[str, ...] = ()  # entries of a directory or glob that were not read (for the record only)


@dataclass(frozen=True)
class RunIdentity:
    seed: int
    max_seq_len: int
    packing: int
    tokenizer: str  # fingerprint of the tokenizer and its chat template
    sources: tuple[SourceRecord, ...]
    tokens_version: int = TOKENS_VERSION  # of the code that parsed, rendered and truncated the rows
    prompt_room: bool = False  # --packing 1 rows planned with room for a system prompt per sample
    room_rule: int = ROOM_RULE  # by which that room was planned (dataset.augment.ROOM_RULE)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict, version: int = RECORD_VERSION) -> RunIdentity:
        """The record as `recorded` wrote it in `version` (KeyError, TypeError or ValueError if it is not)."""
        def later(record: dict, key: str, default, since: int = 3):  # a field that records before `since` lack
            return record.get(key, default) if version < since else record[key]

        sources = tuple(SourceRecord(source["spec"], float(source["weight"]), str(source["share"]),
                                     tuple(SourceFile(**{**file, "samples_digest": later(file, "samples_digest", None,
                                                                                          since=5)})
                                           for file in source["files"]),
                                     tuple(later(source, "left_out", ())))
                        for source in saved["sources"])
        return cls(int(saved["seed"]), int(saved["max_seq_len"]), int(saved["packing"]), str(saved["tokenizer"]),
                   sources, int(later(saved, "tokens_version", UNRECORDED_TOKENS_VERSION)),
                   bool(later(saved, "prompt_room", False, since=4)), int(later(saved, "room_rule", 1, since=6)))

    def legacy_fixed(self) -> dict:
        """These facts in the form of a version 1 record (`sample_stream["fixed"]`)."""
        many = len(self.sources) > 1
        digests = [[file.digest for file in source.files] for source in self.sources]
        if len(digests) == 1 and len(digests[0]) == 1:
            content = digests[0][0][:16]
        else:
            content = hashlib.sha256("|".join(",".join(files) for files in digests).encode()).hexdigest()[:16]
        return {
            "--seed": self.seed,
            "--data_path weights": ",".join(f"{source.weight:g}" for source in self.sources) if many else "1",
            "--data_path content": content,
            "--tokenizer_path (tokenizer and chat template)": self.tokenizer,
            "--max_seq_len": self.max_seq_len,
            "--packing": self.packing,
        }


def identify_run(args, tokenizer, sources) -> RunIdentity:
    """The record of a run whose training data was built from `sources`: (Source, [SFTDataset per
    file]) pairs, in --data_path order (trainer/data_setup.py)."""
    total = sum(Fraction(source.weight) for source, _ in sources)
    records = tuple(
        SourceRecord(
            spec=source.spec, weight=source.weight,
            share=str(Fraction(source.weight) / total) if len(sources) > 1 else "1",
            files=tuple(SourceFile(str(samples.data_path), samples.data_digest, len(samples), samples.samples_digest)
                        for samples in files),
            left_out=tuple(str(path) for path in source.ignored),
        )
        for source, files in sources
    )
    prompt_room = bool(args.packing) and any(samples.prompt_room is not None for _, files in sources for samples in files)
    return RunIdentity(args.seed, args.max_seq_len, args.packing, tokenizer_fingerprint(tokenizer)[:16], records,
                       prompt_room=prompt_room)


def recorded(identity: RunIdentity, grouping: int | None) -> dict:
    """The `sample_stream` entry of a resume checkpoint."""
    return {"version": RECORD_VERSION, "identity": identity.to_dict(), "epoch_grouping": grouping}


def saved_epoch_grouping(saved: dict) -> int | None:
    """The group size that ordered the checkpoint's epoch (derived from its flags where it records none)."""
    if "sample_stream" in saved:
        return saved["sample_stream"]["epoch_grouping"]
    flags = saved["args"]
    if not flags.get("group_by_length", 1):
        return None
    return flags["batch_size"] * saved["world_size"] * flags.get("accumulation_steps", 1)


def epoch_grouping(args, world_size: int) -> int | None:
    """The sampler's group size: one optimizer step's global batch, or None without grouping."""
    return args.batch_size * world_size * args.accumulation_steps if args.group_by_length else None


def refusal(saved: dict, now: RunIdentity, save_dir: str) -> str | None:
    """One line naming the first fact of the sample stream the resume changes and what to do, or None."""
    stream = saved.get("sample_stream", {})
    flags = saved["args"]
    model_dir = Path(flags.get("save_dir", save_dir)) / MODEL_DIR
    new_run = f"start a new run from its weights with --from_weight {model_dir} --save_dir NEW_DIR"
    if "identity" in stream:
        version = stream.get("version", 2)
        try:
            if not isinstance(version, int) or version > RECORD_VERSION:
                raise ValueError(f"version {version}; this minisft reads up to {RECORD_VERSION}")
            before = RunIdentity.from_dict(stream["identity"], version)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            reason = f"no {error}" if isinstance(error, KeyError) else str(error).splitlines()[0]
            return (f"cannot resume: the checkpoint's record of its sample stream (version {version}) cannot be "
                    f"read ({reason}); resume with the minisft version that wrote the checkpoint, or {new_run}")
        found = difference(before, now, flags)
    else:
        found = legacy_difference(stream.get("fixed"), now, flags)
    if found is None:
        return None
    what, before, after, keep = found
    return (f"cannot resume: {what} differs from the checkpoint's run (checkpoint {before}, now {after}), so its "
            f"position in the epoch would mean other samples; {keep}, or {new_run}")


def difference(before: RunIdentity, now: RunIdentity, flags: dict) -> tuple | None:
    """(what, checkpoint's value, this run's value, what to do) of the first difference, or None."""
    for name in ("seed", "max_seq_len", "packing"):
        if getattr(before, name) != getattr(now, name):
            return f"--{name}", getattr(before, name), getattr(now, name), f"resume with --{name} {getattr(before, name)}"
    if before.prompt_room != now.prompt_room:
        return prompt_room_difference(before.prompt_room, now.prompt_room)
    if now.prompt_room and before.room_rule != now.room_rule:
        return ("the rule that finds a sample's own system prompt (dataset.augment.ROOM_RULE: --packing 1 plans the "
                "rows' room for a system prompt by it)", before.room_rule, now.room_rule,
                "resume with the minisft version that wrote the checkpoint")
    if before.tokenizer != now.tokenizer:
        return ("--tokenizer_path (tokenizer and chat template)", before.tokenizer, now.tokenizer,
                "resume with the tokenizer it was trained with")
    if before.tokens_version != now.tokens_version:
        return tokens_difference(before.tokens_version, now)
    if [source.share for source in before.sources] != [source.share for source in now.sources]:
        return ("--data_path weights", ",".join(exact(source.weight) for source in before.sources),
                ",".join(exact(source.weight) for source in now.sources),
                f"resume with the same sources and weights (--data_path {flags.get('data_path')})")
    return data_difference(before.sources, now.sources, flags)


def prompt_room_difference(before: bool, now: bool) -> tuple:
    def ratio(room: bool) -> str:
        return "above 0" if room else "0"

    return ("--system_prompt_ratio (with --packing 1 it sets room for a system prompt in the rows)", ratio(before),
            ratio(now), f"resume with --system_prompt_ratio {ratio(before)}")


def tokens_difference(before: int, now: RunIdentity) -> tuple:
    return ("the tokenizing code (dataset.cache.key.TOKENS_VERSION)", before, now.tokens_version,
            "resume with the minisft version that wrote the checkpoint")


def exact(weight: float) -> str:
    """A weight as short as it reads and as long as it takes to be exact (1, 0.5, 1.000004)."""
    short = f"{weight:g}"
    return short if float(short) == weight else repr(weight)


def data_difference(before: tuple[SourceRecord, ...], now: tuple[SourceRecord, ...], flags: dict) -> tuple | None:
    """(what, checkpoint's, this run's description, what to do) of the first file that differs, or None.

    Files are compared by content (sha256 and samples: their number, and their digest where both
    records hold one), in order, not by path: a byte-identical file moved or renamed (a data directory
    mounted elsewhere) is the same data and resumes. The same bytes give other samples where the runs
    leave out other rows as bad: another --bad_data, or code of other rules
    (dataset.cache.key.ROWS_VERSION, which is not compared itself: code of other rules that keeps the
    same rows of this data resumes)."""
    same_data = f"resume with the data it was trained on ({flags.get('data_path')}, unchanged)"
    bad_data = f"--bad_data {flags['bad_data']}" if flags.get("bad_data") else "its --bad_data"
    other_rows = ("the same bytes give other samples where other rows are left out as bad (another --bad_data, or "
                  "other rules of bad rows: dataset.cache.key.ROWS_VERSION): resume with "
                  f"{bad_data} and the minisft version that wrote the checkpoint")
    for old, new in zip(before, now):
        if len(old.files) != len(new.files):
            old_paths, new_paths = [file.path for file in old.files], [file.path for file in new.files]
            changes = ([f"new {path}" for path in new_paths if path not in old_paths]
                       + [f"missing {path}" for path in old_paths if path not in new_paths])
            return ("--data_path content", f"{len(old_paths)} file(s) in {old.spec}",
                    f"{len(new_paths)} file(s): {'; '.join(changes) or 'the same names'}", same_data)
        for old_file, new_file in zip(old.files, new.files):
            where = "" if new_file.path == old_file.path else f"{new_file.path} "
            if old_file.digest != new_file.digest:
                return ("--data_path content", f"{old_file.path} sha256 {old_file.digest[:16]}",
                        f"{where}sha256 {new_file.digest[:16]}", same_data)
            if old_file.samples != new_file.samples:
                return ("the number of samples of --data_path", f"{old_file.path} with {old_file.samples} samples",
                        f"{where}{new_file.samples}", other_rows)
            if None not in (old_file.samples_digest, new_file.samples_digest) and (
                    old_file.samples_digest != new_file.samples_digest):
                return ("the samples' digest of --data_path", f"{old_file.path} with samples sha256 "
                        f"{old_file.samples_digest[:16]}", f"{where}{new_file.samples_digest[:16]}", other_rows)
    return None


def legacy_difference(before: dict | None, now: RunIdentity, flags: dict) -> tuple | None:
    """`difference` for a checkpoint with a version 1 record (the `fixed` dict) or none (only its flags)."""
    if before is None:  # a checkpoint without a sample-stream record: compare its flags
        before = {"--seed": flags.get("seed"), "--max_seq_len": flags.get("max_seq_len"),
                  "--packing": flags.get("packing", 0)}
    current = now.legacy_fixed()
    changed = [name for name, value in before.items() if name in current and current[name] != value]
    if not changed:
        if now.prompt_room:
            return prompt_room_difference(False, True)
        if now.tokens_version != UNRECORDED_TOKENS_VERSION:
            return tokens_difference(UNRECORDED_TOKENS_VERSION, now)
        return None
    name = changed[0]
    if name == "--data_path content":
        keep = f"resume with the data it was trained on ({flags.get('data_path')}, unchanged)"
    elif name == "--data_path weights":
        keep = f"resume with the same sources and weights (--data_path {flags.get('data_path')})"
    elif isinstance(before[name], int):
        keep = f"resume with {name} {before[name]}"
    else:
        keep = "resume with the tokenizer it was trained with"
    return name, before[name], current[name], keep


def check_and_pin(saved: dict, identity: RunIdentity, save_dir: str, sampler, log) -> str | None:
    """The refusal message, else pin the interrupted epoch's order in `sampler`. An epoch the checkpoint
    has not started (saved at the step that ended the one before) takes this run's grouping."""
    problem = refusal(saved, identity, save_dir)
    if problem:
        return problem
    grouping = saved_epoch_grouping(saved)
    if grouping != sampler.group_size and saved["samples_in_epoch"] > 0:
        sampler.pin_epoch_grouping(saved["epoch"], grouping)
        log(f"finishing epoch {saved['epoch'] + 1} in the checkpoint's order (length groups of "
            f"{grouping or 'none'}; now {sampler.group_size or 'none'}), so every sample of it is seen once; "
            "later epochs use the new grouping")
    return None
