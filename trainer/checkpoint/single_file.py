"""The single-file resume checkpoint (`checkpoints/step_XXXXXXXX.pt`): one `torch.save` archive of a
dict, `{"format": "minisft-resume", "format_version": 1, ...}` with the model and optimizer state
dicts, the position (step, epoch, samples_in_epoch), every rank's RNG state, the flags and the run's
identity (trainer/run_identity.py). Read with `torch.load(weights_only=True)`, memory-mapped.

A sharded checkpoint's `meta.pt` (trainer/checkpoint/sharded.py) is such a file without the tensors."""

import os

from trainer.checkpoint.files import atomic_torch_save, remove_stale_temporaries, safe_torch_load
from trainer.checkpoint.save_dir import checkpoint_path, checkpoints_dir, drop_old_checkpoints
from trainer.errors import CheckpointError

FORMAT = "minisft-resume"
FORMAT_VERSION = 1


def stamped(state: dict) -> dict:
    """`state` with the format's name and version in front."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, **state}


def save(state: dict, save_dir: str, keep_last: int) -> str:
    """Write one resume checkpoint, then drop all but the newest `keep_last`."""
    path = checkpoint_path(save_dir, state["step"])
    remove_stale_temporaries(checkpoints_dir(save_dir))
    atomic_torch_save(stamped(state), path)
    drop_old_checkpoints(save_dir, keep_last)
    return path


def load(path: str, required) -> dict:
    """Read and validate a single-file checkpoint (or a sharded one's meta.pt); never unpickles
    arbitrary objects. Memory-mapped: the ranks of one node share the page cache instead of each
    holding the whole file. `required` names the entries the caller needs."""
    if not os.path.isfile(path):
        raise CheckpointError(f"resume checkpoint {path} does not exist")
    state = safe_torch_load(path, label="resume checkpoint ")
    check_format(state, path)
    missing = [key for key in required if key not in state]
    if missing:
        raise CheckpointError(f"resume checkpoint {path} is incomplete (missing {', '.join(missing)})")
    return state


def is_resume_state(loaded) -> bool:
    """Whether a loaded torch file is one of our resume checkpoints (else, e.g., a plain state dict)."""
    return isinstance(loaded, dict) and loaded.get("format") == FORMAT


def check_format(state, path: str) -> None:
    if not is_resume_state(state):
        raise CheckpointError(f"{path} is not a minisft resume checkpoint")
    version = state.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer minisft (format version {version}; this version reads up to "
            f"{FORMAT_VERSION}): upgrade minisft to resume from it"
        )
