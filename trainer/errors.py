"""Every problem a user can fix (flags, data, paths, checkpoints, the launch, a full disk named by
path), one class each, and the one helper that turns a library's exception into one line.

`train_full_sft.py` reports a `USER_ERRORS` exception as `error: <message>` and exits with 2 (a
`TrainingError` with 1); anything else is a bug in our code and keeps its traceback. Each message
is a single line that names the file, flag or setting at fault and, where there is one, what to do.
"""

from dataset import BuildInterrupted, DataError, WorkerDied  # noqa: F401 - re-exported: the data's own errors


class CheckpointError(ValueError):
    """A checkpoint, weights file or save directory that cannot be used, with a one-line reason."""


class ConfigError(ValueError):
    """Flags that do not describe a valid model or run."""


class DistributedError(RuntimeError):
    """A launch that cannot work (devices, backend, rendezvous), with a one-line reason."""


class SelectionError(ValueError):
    """--keep_best / --early_stop_patience that cannot work with this run's eval data."""


class LoggingError(RuntimeError):
    """wandb or metrics.jsonl cannot be used as asked."""


class ModelLoadError(ValueError):
    """A model path that cannot be loaded; the message is one line naming the path and the problem."""


class TrainingError(RuntimeError):
    """The run had to stop (e.g. too many non-finite steps); the message says why. Exit code 1."""


USER_ERRORS = (DataError, CheckpointError, ConfigError, DistributedError, SelectionError, LoggingError, WorkerDied)


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first non-empty line of `error`'s message (at most `limit` characters), else its type."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[0][:limit] if lines else type(error).__name__
