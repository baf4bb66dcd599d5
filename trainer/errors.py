"""Every problem a user can fix (flags, data, paths, checkpoints, the launch, a full disk named by
path), one class each, and which OSErrors name a path the user gave; re-exported from dataset/:
the data's own errors and `first_line`, which turns a library's exception into part of a line.

`train_full_sft.py` reports a `USER_ERRORS` exception as `error: <message>` and exits with 2 (a
`TrainingError` with 1); anything else is a bug in our code and keeps its traceback. Each message
is a single line that names the file, flag or setting at fault and, where there is one, what to do.
"""

import argparse
import os

from dataset import BuildInterrupted, DataError, WorkerDied  # noqa: F401 - re-exported: the data's own errors
from dataset.formats import first_line  # noqa: F401 - re-exported: a library's exception as part of a line
from dataset.mixture import split_weight


class CheckpointError(ValueError):
    """A checkpoint, weights file or save directory that cannot be used, with a one-line reason."""


class ConfigError(ValueError):
    """Flags that do not describe a valid model or run."""


class DistributedError(RuntimeError):
    """A launch that cannot work (devices, backend, rendezvous), with a one-line reason."""


class NodeLaunchError(DistributedError):
    """A launch that cannot work, found before the process group starts and alike by every process
    of the node (same flags, environment and devices): printed by local rank 0 only
    (trainer/runtime/node_lines.py)."""


class SelectionError(ValueError):
    """--keep_best / --early_stop_patience that cannot work with this run's eval data."""


class LoggingError(RuntimeError):
    """wandb or metrics.jsonl cannot be used as asked."""


class ModelLoadError(ValueError):
    """A model path that cannot be loaded; the message is one line naming the path and the problem."""


class TrainingError(RuntimeError):
    """The run had to stop (e.g. too many non-finite steps); the message says why. Exit code 1.
    `every_rank`: every rank stops with this very line (a decision they share), printed once."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


USER_ERRORS = (DataError, CheckpointError, ConfigError, DistributedError, SelectionError, LoggingError, WorkerDied)


PATH_FLAGS = ("data_path", "eval_data_path", "tokenizer_path", "save_dir", "resume_from", "cache_dir", "from_weight")


def names_a_user_path(error: OSError, args: argparse.Namespace) -> bool:
    """Whether `error` is about a path the user named (or one inside a folder the user named):
    then it is the user's to fix (permissions, a full disk, a file where a folder belongs).
    Other OSErrors are bugs of ours and keep their traceback."""
    if not error.filename or not isinstance(error.filename, (str, bytes, os.PathLike)):
        return False
    path = os.path.abspath(os.fsdecode(error.filename))
    for name in PATH_FLAGS:
        for given in str(getattr(args, name, None) or "").split(","):
            given = split_weight(given)[0] if name == "data_path" else given
            if given and given != "none":
                given = os.path.abspath(given)
                if name in ("data_path", "eval_data_path") and not args.cache_dir:
                    given = os.path.dirname(given)  # the token cache is written next to the data by default
                if path == given or path.startswith(given.rstrip(os.sep) + os.sep) or given.startswith(path + os.sep):
                    return True
    return False
