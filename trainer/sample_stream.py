"""The settings that decide which samples a run trains on and in which order: recorded in every
resume checkpoint (`recorded`) and compared when resuming (`check_and_pin`).

Two kinds:
- fixed settings (`fixed_settings`): seed, the training data (the sources' weights and every
  file's content, in order), the tokenizer, `--max_seq_len`, `--packing`. The checkpoint's
  position ("N samples of epoch E consumed") only means something in the sample stream they
  define, so a resume that changes one is refused with one line naming the setting and what to do.
- the epoch's length grouping (`epoch_grouping`): `--group_by_length` and the global batch
  (batch_size x world_size x accumulation_steps) shape the order of an epoch. These may change on
  resume: the interrupted epoch is finished in the order the checkpoint's run used (the sampler
  pins it), later epochs use the new settings. No sample of the epoch is seen twice or never.

To add a setting that defines the stream, add an entry to `fixed_settings`, keyed by the flag
name the refusal should show.
"""

import functools
import hashlib
from pathlib import Path

from dataset.mixture import parse_data_path
from dataset.rendering import tokenizer_fingerprint
from dataset.token_cache import data_digest, default_cache_root


def fixed_settings(args, tokenizer) -> dict:
    """Settings a resume must keep, keyed by how the refusal names them."""
    sources = parse_data_path(args.data_path)
    return {
        "--seed": args.seed,
        # the sources' weights (one source: every sample once per epoch, whatever its weight); their files
        # and order are in the content
        "--data_path weights": ",".join(f"{source.weight:g}" for source in sources) if len(sources) > 1 else "1",
        "--data_path content": data_fingerprint(sources, getattr(args, "cache_dir", None)),
        "--tokenizer_path (tokenizer and chat template)": tokenizer_fingerprint(tokenizer)[:16],
        "--max_seq_len": args.max_seq_len,
        "--packing": args.packing,
    }


def data_fingerprint(sources, cache_dir) -> str:
    """The training files' content: one file's sha256 (16 hex digits), else a sha256 over every
    source's files' sha256s, in order. The digests are the token cache's own (`data_digest`,
    memoized under <cache>/.digests by a cheap key), so an unchanged file is not hashed again;
    within a process the result is kept per file version (every save asks)."""
    versions = tuple(tuple((str(path), path.stat().st_size, path.stat().st_mtime_ns) for path in source.files)
                     for source in sources)
    return _fingerprint(versions, cache_dir)


@functools.lru_cache(maxsize=8)
def _fingerprint(versions: tuple, cache_dir) -> str:
    digests = [[data_digest(Path(path), default_cache_root(Path(path), cache_dir)) for path, _, _ in files]
               for files in versions]
    if len(digests) == 1 and len(digests[0]) == 1:
        return digests[0][0][:16]
    return hashlib.sha256("|".join(",".join(files) for files in digests).encode()).hexdigest()[:16]


def epoch_grouping(args, world_size: int) -> int | None:
    """The sampler's group size: one optimizer step's global batch, or None without grouping."""
    return args.batch_size * world_size * args.accumulation_steps if args.group_by_length else None


def recorded(args, tokenizer, sampler) -> dict:
    """The `sample_stream` entry of a resume checkpoint."""
    return {"fixed": fixed_settings(args, tokenizer), "epoch_grouping": sampler.epoch_group_size()}


def saved_epoch_grouping(saved: dict) -> int | None:
    """The group size that ordered the checkpoint's epoch (derived from its flags for old checkpoints)."""
    if "sample_stream" in saved:
        return saved["sample_stream"]["epoch_grouping"]
    flags = saved["args"]
    if not flags.get("group_by_length", 1):
        return None
    return flags["batch_size"] * saved["world_size"] * flags.get("accumulation_steps", 1)


def refusal(saved: dict, args, tokenizer) -> str | None:
    """One line naming the first fixed setting the resume changes and what to do, or None."""
    before = saved.get("sample_stream", {}).get("fixed")
    if before is None:  # a checkpoint from before sample streams were recorded: compare its flags
        before = {"--seed": saved["args"].get("seed"), "--max_seq_len": saved["args"].get("max_seq_len"),
                  "--packing": saved["args"].get("packing", 0)}
    now = fixed_settings(args, tokenizer)
    changed = [name for name, value in before.items() if name in now and now[name] != value]
    if not changed:
        return None
    name = changed[0]
    if name == "--data_path content":
        keep = f"resume with the data it was trained on ({saved['args'].get('data_path')}, unchanged)"
    elif name == "--data_path weights":
        keep = f"resume with the same sources and weights (--data_path {saved['args'].get('data_path')})"
    elif isinstance(before[name], int):
        keep = f"resume with {name} {before[name]}"
    else:
        keep = "resume with the tokenizer it was trained with"
    return (f"cannot resume: {name} differs from the checkpoint's run (checkpoint {before[name]}, now {now[name]}), "
            f"so its position in the epoch would mean other samples; {keep}, or start a new run from its weights "
            f"with --from_weight {Path(saved['args'].get('save_dir', args.save_dir)) / 'model'} --save_dir NEW_DIR")


def check_and_pin(saved: dict, args, tokenizer, sampler, is_main: bool, log) -> str | None:
    """Refusal message (computed on rank 0 only), else pin the interrupted epoch's order."""
    if is_main:
        problem = refusal(saved, args, tokenizer)
        if problem:
            return problem
    grouping = saved_epoch_grouping(saved)
    if grouping != sampler.group_size:
        sampler.pin_epoch_grouping(saved["epoch"], grouping)
        log(f"finishing epoch {saved['epoch'] + 1} in the checkpoint's order (length groups of "
            f"{grouping or 'none'}; now {sampler.group_size or 'none'}), so every sample of it is seen once; "
            "later epochs use the new grouping")
    return None
