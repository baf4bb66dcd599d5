"""The layout of a run's `--save_dir`, and the rules that keep one run's files apart from another's:

    checkpoints/step_00000100.pt   resume state, one file (trainer/checkpoint/single_file.py)
    checkpoints/step_00000100.dcp/ the same, sharded (`--fsdp 1`; trainer/checkpoint/sharded.py)
    model/                         inference weights: config.json, model.safetensors (`--save_dtype`)
                                   and the tokenizer; a standard Qwen3 / Qwen3-MoE directory
                                   (written by trainer/weights/write.py)
    best/                          the same, for the best evaluation (`--keep_best`), with best.json
                                   (trainer/evaluation/selection.py); never rotated
    metrics.jsonl, .lock           the run's log (trainer/run_logger.py) and its lock (`SaveDirLock`)
    PREFIX_HIDDEN[_moe].pth        MiniMind's state dict, with `--save_weight PREFIX` (trainer/weights/write.py)
    set_aside/                     what a rollback or `--overwrite 1` moved away; nothing is deleted

Rotation keeps the newest `--keep_last` resume checkpoints.
"""

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from trainer.checkpoint.files import fsync_dir
from trainer.errors import CheckpointError

FILE_SUFFIX = ".pt"  # step_00000100.pt: one file
SHARDED_SUFFIX = ".dcp"  # step_00000100.dcp: a directory of shards
CHECKPOINT_PATTERN = re.compile(rf"^step_(\d{{8,}})({re.escape(FILE_SUFFIX)}|{re.escape(SHARDED_SUFFIX)})$")
CHECKPOINTS_DIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"  # a run's log (trainer/run_logger.py writes it)
MODEL_DIR = "model"
BEST_DIR = "best"
BEST_FILE = "best.json"
SET_ASIDE_DIR = "set_aside"
NO_RUN_ID = "(no run id recorded)"  # names the run of a checkpoint that records no run id
SAVED_FOLDERS = (CHECKPOINTS_DIR, MODEL_DIR, BEST_DIR)  # the folders of a save_dir that saves write into


# --------------------------------------------------------------------------- paths


def checkpoints_dir(save_dir: str) -> str:
    return os.path.join(save_dir, CHECKPOINTS_DIR)


def checkpoint_path(save_dir: str, step: int, suffix: str = FILE_SUFFIX) -> str:
    """The resume checkpoint of ``step``: a file (FILE_SUFFIX) or a directory of shards (SHARDED_SUFFIX)."""
    return os.path.join(checkpoints_dir(save_dir), f"step_{step:08d}{suffix}")


def list_checkpoints(save_dir: str) -> list[str]:
    """Resume checkpoints in `save_dir`, newest (highest step) first."""
    folder = checkpoints_dir(save_dir)
    if not os.path.isdir(folder):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(folder) if (m := CHECKPOINT_PATTERN.match(name))]
    return [os.path.join(folder, name) for _, name in sorted(found, reverse=True)]


def checkpoints_folder_problem(path: str) -> str | None:
    """`path` is a run's `checkpoints/` folder, given where one model is asked for: what to give
    instead (one checkpoint, or the run's directory), else None."""
    run = os.path.dirname(os.path.abspath(path))
    found = list_checkpoints(run) if os.path.basename(os.path.abspath(path)) == CHECKPOINTS_DIR else []
    if not found:
        return None
    return (f"{path} is a run's folder of resume checkpoints: give one of them ({os.path.basename(found[0])}) "
            f"or the run's directory {run}")


def step_of(path: str) -> int:
    return int(CHECKPOINT_PATTERN.match(os.path.basename(path)).group(1))


def new_run_id() -> str:
    """Names one line of training: kept in its checkpoints and metrics.jsonl rows, kept across resumes."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def run_label(run_id: str | None) -> str:
    """How a line names the run `run_id` of a checkpoint (`NO_RUN_ID` where it records none)."""
    return run_id or NO_RUN_ID


def ensure_writable_dir(path: str) -> None:
    """Fail before training, not at the first save, when `path` cannot be written, or a folder of it
    that saves write into (checkpoints/) or replace by renaming a new one over it (model/, best/),
    which needs it writable too. A file created and removed in each tells (permission bits do not: a
    read-only mount refuses root too). A model/ or best/ that is a symlink is not probed: a save
    renames the link, not its target."""
    check_folder_can_be_made(path, "--save_dir")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f"--save_dir {path} is not writable: {error.strerror or error}") from error
    problem = _write_problem(path)
    if problem:
        raise CheckpointError(f"--save_dir {path} is not writable: {problem}")
    for name in SAVED_FOLDERS:
        folder = os.path.join(path, name)
        if not os.path.isdir(folder) or (name != CHECKPOINTS_DIR and os.path.islink(folder)):
            continue
        problem = _write_problem(folder)
        if problem and problem != os.strerror(errno.ENOENT):  # gone: renamed by a live run's save, which the lock meets
            raise CheckpointError(f"--save_dir {path} is not writable: {folder}: {problem}")


def _write_problem(folder: str) -> str | None:
    """Why a file cannot be created in `folder` (None: it can); the probe never stays behind."""
    probe = os.path.join(folder, f".write_probe.{os.getpid()}")
    try:
        with open(probe, "wb") as handle:
            handle.write(b"ok")
    except OSError as error:
        return error.strerror or str(error)
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
    return None


def check_folder_can_be_made(path: str, flag: str) -> None:
    """Fail when `path`, the folder of `flag`, cannot be one: it, or the nearest of its parents that
    exists, is a file, or cannot be written. Creates nothing: a run refused later leaves no folder."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise CheckpointError(f"{flag} {path} cannot be a folder: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"{flag} {path} is not writable: {existing}: permission denied")


# --------------------------------------------------------------------------- one run per save_dir


def set_aside(save_dir: str, paths: list[str], reason: str) -> str:
    """Move `paths` (files or folders of `save_dir`) into `<save_dir>/set_aside/<time>-<reason>/`,
    keeping their relative paths; nothing is deleted. Returns that folder."""
    folder = os.path.join(save_dir, SET_ASIDE_DIR, time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + reason)
    for path in paths:
        target = os.path.join(folder, os.path.relpath(path, save_dir))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(path, target)
    fsync_dir(save_dir)
    return folder


def rollback_reason(step: int) -> str:
    """The suffix of the set_aside/ folder of a rollback to `step` (`set_aside_later_checkpoints`)."""
    return f"after-step-{step}"


def set_aside_by_rollbacks_to(save_dir: str, step: int) -> list[str]:
    """The checkpoints that rollbacks to `step` set aside in `save_dir`, newest first within each folder."""
    root = os.path.join(save_dir, SET_ASIDE_DIR)
    folders = sorted(name for name in os.listdir(root) if name.endswith("-" + rollback_reason(step))) \
        if os.path.isdir(root) else []
    return [path for name in folders for path in list_checkpoints(os.path.join(root, name))]


def set_aside_later_checkpoints(save_dir: str, step: int, log=print) -> bool:
    """A resume to an earlier step starts a new line of training: the later checkpoints of the old
    line would outrank (and rotate away) the new ones, so they are moved aside, named, not deleted."""
    later = [path for path in list_checkpoints(save_dir) if step_of(path) > step]
    best_step = best_step_on_disk(save_dir)
    if best_step is not None and best_step > step:  # best/ of the old line: the new line keeps its own
        later.append(os.path.join(save_dir, BEST_DIR))
    if later:
        names = ", ".join(os.path.basename(path) for path in reversed(later))
        folder = set_aside(save_dir, later, rollback_reason(step))
        log(f"resuming at step {step} while later checkpoints exist: moved {names} to {folder} "
            "(the new line of training replaces them; delete that folder once you do not need it)")
    return bool(later)


@dataclass
class Claim:
    """How a run takes its --save_dir, decided before anything there moves: the previous run's files that
    rank 0 sets aside (`carry_out`) once every check of the run has passed, so a refused run leaves them
    where they are; and `forked_from` ({run_id, step, checkpoint}) for a --resume_from of a run that the
    directory does not hold, which goes on there as a new run (trainer/checkpoint/resume.py)."""

    save_dir: str
    previous: list[str] = field(default_factory=list)
    reason: str = ""  # the suffix of their set_aside/ folder
    why: str = ""  # what moves them, for the line that says so
    forked_from: dict | None = None

    def carry_out(self, log=print) -> None:
        if not self.previous:
            return
        folder = set_aside(self.save_dir, self.previous, self.reason)
        log(f"{self.why}: moved the previous run's {', '.join(os.path.basename(p) for p in self.previous)} to {folder}")


def claim_for_fresh_run(save_dir: str, overwrite: bool, resuming: bool = False, pth_name: str | None = None,
                        resumed: str | None = None) -> Claim:
    """Refuse to start a new run in a directory holding another run's files (checkpoints, model/, best/,
    `pth_name`: the MiniMind .pth that this run's --save_weight writes, or only its metrics.jsonl, of a
    run stopped before its first save) unless `overwrite`; then they are to be moved aside, not deleted
    (the `Claim`). A .pth of another name is no run's file here (MiniMind's out/ keeps the --from_weight
    pretrain_768.pth beside full_sft_768.pth): it stays; a checkpoints/ without a checkpoint holds nothing
    of a run. `resuming` (--from_resume 1 finding no checkpoint): a run without a checkpoint has nothing to
    continue, so its best/ and metrics.jsonl are moved aside as well, with a line (a restarted job starts
    afresh instead of appending to them). `resumed`: the run (`run_label`) of the --resume_from checkpoint
    that this run goes on from here (trainer/checkpoint/resume.py:claim_for_resume); its saves would rotate
    away and replace the directory's own files just the same."""
    model_dir = os.path.join(save_dir, MODEL_DIR)
    if os.path.isdir(model_dir) and any(name.endswith(".py") for name in os.listdir(model_dir)):
        raise CheckpointError(f"--save_dir {save_dir}: its {MODEL_DIR}/ holds Python source (minisft's own package?), "
                              "not a run's weights, and is never moved: choose another --save_dir")
    checkpoints = list_checkpoints(save_dir)
    previous = [os.path.join(save_dir, name) for name in SAVED_FOLDERS
                if os.path.lexists(os.path.join(save_dir, name)) and (name != CHECKPOINTS_DIR or checkpoints)]
    if os.path.isfile(os.path.join(save_dir, METRICS_FILE)):  # a run's log (anything else fails at its first write)
        previous.append(os.path.join(save_dir, METRICS_FILE))
    pth = os.path.join(save_dir, pth_name) if pth_name else None
    if pth and os.path.lexists(pth):
        previous.append(pth)
    if not previous:
        return Claim(save_dir)
    has_run = checkpoints or os.path.isdir(os.path.join(save_dir, MODEL_DIR))
    # a .pth is written with a checkpoint: one without any is no restarted job's (downloaded weights?)
    if not (overwrite or (resuming and not has_run and pth not in previous)):
        what = "checkpoints/ or model/" if has_run else " and ".join(os.path.basename(path) for path in previous)
        instead = " instead of --resume_from" if resumed else ""
        keep_on = f"continue it with --from_resume 1{instead}, " if has_run else ""
        other = f"another run ({what})" + (f", not the run {resumed} of the --resume_from checkpoint" if resumed else "")
        raise CheckpointError(
            f"--save_dir {save_dir} holds {other}: {keep_on}choose another --save_dir, or pass "
            f"--overwrite 1 to {'resume' if resumed else 'start over'} there (its files are moved to "
            f"{os.path.join(save_dir, SET_ASIDE_DIR)}/)"
        )
    if overwrite:
        return Claim(save_dir, previous, "overwritten", "--overwrite 1")
    return Claim(save_dir, previous, "no-checkpoint", "--from_resume 1 found no checkpoint to continue")


def logged_rows(save_dir: str) -> Iterator[dict]:
    """The rows of `<save_dir>/metrics.jsonl`, in order; a line that is no row (the half-written last
    line of a crash) is left out."""
    try:
        with open(os.path.join(save_dir, METRICS_FILE), encoding="utf-8", errors="replace") as handle:
            for line in handle:
                with contextlib.suppress(ValueError):
                    row = json.loads(line)
                    if isinstance(row, dict):
                        yield row
    except OSError:
        pass


class SaveDirLock:
    """An exclusive lock on `<save_dir>/.lock`, held while this process lives: a second run
    writing to the same directory would mix or prune the first one's checkpoints.

    A POSIX record lock (`lockf`), not `flock`: it belongs to this process only, so DataLoader
    workers forked from it do not keep it after a `kill -9` of the trainer (an elastic restart
    would otherwise find the directory "in use"); the kernel drops it when the process dies."""

    def __init__(self, save_dir: str):
        self.path = os.path.join(save_dir, ".lock")
        self.handle = None

    def acquire(self) -> "SaveDirLock":
        handle = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.lockf(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                handle.close()
                raise
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            if holder == str(os.getpid()):  # an earlier run in this process (main() called again) still holds it
                return self
            raise CheckpointError(
                f"save_dir {os.path.dirname(self.path)} in use by pid {holder} (another training run writes there): "
                "wait for it to end, or choose another --save_dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self.handle = handle
        return self

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing the file drops the lock
            self.handle = None


def is_run_dir(path: str) -> bool:
    """Whether a training run wrote or writes in the folder `path`: it has checkpoints/ or
    metrics.jsonl, or its .lock is held by a live process (a `.lock` alone is a common name)."""
    if not os.path.isdir(path):
        return False
    return (any(os.path.lexists(os.path.join(path, name)) for name in (CHECKPOINTS_DIR, METRICS_FILE))
            or lock_holder(path) is not None)


def run_dir_at_or_above(path: str) -> str | None:
    """The training run directory (`is_run_dir`) that `path` is or lies in, else None."""
    current = os.path.abspath(path)
    while True:
        if is_run_dir(current):
            return current
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def run_dir_below(path: str) -> str | None:
    """A training run directory inside the folder `path` (not `path` itself), else None."""
    for folder, subfolders, _ in os.walk(path):
        for name in subfolders:
            if is_run_dir(os.path.join(folder, name)):
                return os.path.join(folder, name)
    return None


def lock_holder(save_dir: str) -> int | None:
    """The pid of the process that holds `<save_dir>/.lock` (`SaveDirLock`), else None. Only asks
    the kernel (F_GETLK): takes no lock and never disturbs one, not even this process's own."""
    path = os.path.join(save_dir, ".lock")
    if not os.path.isfile(path):
        return None
    try:
        handle = open(path, "rb")
    except OSError:
        return None
    with handle:
        if sys.platform.startswith("linux"):  # struct flock: short type, whence; off_t start, len; pid_t pid
            query = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
            try:
                answer = fcntl.fcntl(handle.fileno(), fcntl.F_GETLK, query)
            except OSError:
                return None
            kind, _, _, _, pid = struct.unpack("hhqqi4x", answer)
            return pid if kind != fcntl.F_UNLCK else None
        try:  # elsewhere: try to take it (a POSIX lock of this process is then dropped by the close)
            fcntl.lockf(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return int(handle.read().strip() or 0) or -1
    return None


def inside_a_run_model_dir(path: str) -> str | None:
    """The `<run>/model` (or `<run>/best`) directory that `path` is or lies in (a later save replaces
    it), else None; through symlinks (real paths), whose target a save would replace all the same."""
    current = os.path.realpath(path)
    while True:
        parent = os.path.dirname(current)
        if os.path.basename(current) in (MODEL_DIR, BEST_DIR) and (
                os.path.isdir(checkpoints_dir(parent)) or os.path.exists(os.path.join(parent, METRICS_FILE))):
            return current
        if parent == current:
            return None
        current = parent


def drop_old_checkpoints(save_dir: str, keep_last: int) -> None:
    """Delete all but the newest `keep_last` resume checkpoints (files and sharded directories)."""
    for stale in list_checkpoints(save_dir)[keep_last:]:
        try:
            if os.path.isdir(stale):
                remove_directory_checkpoint(stale)
            else:
                os.remove(stale)
        except OSError:
            pass


def remove_directory_checkpoint(path: str) -> None:
    """Rename first (then not a checkpoint name, so a half-deleted one is never taken for one), then delete."""
    doomed = f"{path}.old"
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def best_record_on_disk(save_dir: str) -> dict:
    """`<save_dir>/best/best.json` ({metric, mode, value, step}), or {} (no best/ or an unreadable record)."""
    try:
        with open(os.path.join(save_dir, BEST_DIR, BEST_FILE), encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def best_step_on_disk(save_dir: str) -> int | None:
    """The step recorded in `<save_dir>/best/best.json`, or None."""
    step = best_record_on_disk(save_dir).get("step")
    return step if isinstance(step, int) else None
