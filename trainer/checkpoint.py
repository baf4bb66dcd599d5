"""Steps 3 and 7: resume checkpoints (`lm_checkpoint`) and inference weights.

Layout under `--save_dir`:
    checkpoints/step_00000100.pt   resume state (one file, `torch.load(weights_only=True)`)
    checkpoints/step_00000100.dcp/ the same, sharded (`--fsdp 1`; trainer/sharded_checkpoint.py)
    model/                         inference weights: config.json, model.safetensors
                                   (`--save_dtype`) and the tokenizer; a standard Qwen3 /
                                   Qwen3-MoE directory (trainer/weights_io.py)
    best/                          the same, for the best evaluation (`--keep_best`), with
                                   best.json (trainer/model_selection.py); never rotated

Every file is written to a temporary name, fsynced and renamed, so a crash or a full disk in
the middle of a save never damages the checkpoint that was already there. Temporary files that a
killed process left behind are removed by the next save.
"""

import errno
import fcntl
import os
import pickle
import re
import secrets
import shutil
import time
import zipfile

import torch
from safetensors import SafetensorError

from trainer.model_selection import BEST_DIR, best_step_on_disk

FORMAT = "minisft-resume"
FORMAT_VERSION = 1
# step_00000100.pt: one file; step_00000100.dcp: a directory of shards (trainer/sharded_checkpoint.py)
CHECKPOINT_PATTERN = re.compile(r"^step_(\d{8,})\.(pt|dcp)$")
# Fields that change the shapes or the mathematics of the network.
ARCHITECTURE_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "use_moe", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "tie_word_embeddings", "rope_theta", "rope_yarn", "rms_norm_eps", "norm_topk_prob",
    "router_aux_loss_coef",
)
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with a one-line reason."""


# --------------------------------------------------------------------------- paths


def checkpoints_dir(save_dir: str) -> str:
    return os.path.join(save_dir, "checkpoints")


def checkpoint_path(save_dir: str, step: int) -> str:
    return os.path.join(checkpoints_dir(save_dir), f"step_{step:08d}.pt")


def list_checkpoints(save_dir: str) -> list[str]:
    """Resume checkpoints in `save_dir`, newest (highest step) first."""
    folder = checkpoints_dir(save_dir)
    if not os.path.isdir(folder):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(folder) if (m := CHECKPOINT_PATTERN.match(name))]
    return [os.path.join(folder, name) for _, name in sorted(found, reverse=True)]


def step_of(path: str) -> int:
    return int(CHECKPOINT_PATTERN.match(os.path.basename(path)).group(1))


def new_run_id() -> str:
    """Names one line of training: kept in its checkpoints and metrics.jsonl rows, kept across resumes."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def ensure_writable_dir(path: str) -> None:
    """Fail before training, not at the first save, when `path` cannot be written."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_probe.{os.getpid()}")
        with open(probe, "wb") as handle:
            handle.write(b"ok")
        os.remove(probe)
    except OSError as error:
        raise CheckpointError(f"--save_dir {path} is not writable: {error.strerror or error}") from error


# --------------------------------------------------------------------------- atomic writes


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _WriteErrorRecorder:
    """A write-only file wrapper for `torch.save`, which reports a failed write (disk full, file size
    limit) only as "unexpected pos ..."; this keeps the OSError so the message can name the cause."""

    def __init__(self, handle):
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self.handle.flush()


def remove_stale_temporaries(folder: str) -> None:
    """Delete `*.tmp.<pid>` files of saves that a crash (kill -9, power loss) interrupted."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if ".tmp." in name:
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass


def atomic_torch_save(obj, path: str) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    recorder = None
    try:
        with open(tmp, "wb") as handle:
            recorder = _WriteErrorRecorder(handle)
            torch.save(obj, recorder)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(folder)
    except BaseException as error:
        if os.path.exists(tmp):
            os.remove(tmp)
        cause = (recorder.error if recorder else None) or error
        if isinstance(cause, OSError):
            raise CheckpointError(f"could not write {path}: {cause.strerror or cause}") from error
        raise


def save_inference_weights(model, tokenizer, save_dir: str, dtype: torch.dtype, name: str = "model",
                           extra_files: dict[str, str] | None = None) -> str:
    """Write `<save_dir>/<name>/` (an HF directory, plus `extra_files`: file name -> text) atomically;
    return its path."""
    final = os.path.join(save_dir, name)
    tmp, old = os.path.join(save_dir, f".{name}.tmp.{os.getpid()}"), os.path.join(save_dir, f".{name}.old")
    if os.path.isdir(old) and not os.path.exists(final):  # a crash between the two renames below
        os.replace(old, final)
    for entry in os.listdir(save_dir):  # what killed saves left (the save_dir lock makes this safe)
        if entry.startswith(f".{name}.tmp"):
            shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)
    try:
        from trainer.weights_io import write_inference_dir

        write_inference_dir(model, tmp, dtype)
        tokenizer.save_pretrained(tmp)
        for file_name, text in (extra_files or {}).items():
            with open(os.path.join(tmp, file_name), "w", encoding="utf-8") as handle:
                handle.write(text)
        for file_name in os.listdir(tmp):
            with open(os.path.join(tmp, file_name), "rb") as handle:
                os.fsync(handle.fileno())
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(save_dir)
    except (OSError, SafetensorError) as error:  # safetensors reports a full disk as SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(final) and os.path.exists(old):
            os.replace(old, final)
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error).strip().splitlines()[0]
        raise CheckpointError(f"could not write inference weights to {final}: {reason}") from error
    return final


# --------------------------------------------------------------------------- resume state


def save_resume_checkpoint(state: dict, save_dir: str, keep_last: int) -> str:
    """Write one resume checkpoint, then drop all but the newest `keep_last`."""
    path = checkpoint_path(save_dir, state["step"])
    remove_stale_temporaries(checkpoints_dir(save_dir))
    atomic_torch_save({"format": FORMAT, "format_version": FORMAT_VERSION, **state}, path)
    drop_old_checkpoints(save_dir, keep_last)
    return path


def drop_old_checkpoints(save_dir: str, keep_last: int) -> None:
    """Delete all but the newest `keep_last` resume checkpoints (files and sharded directories)."""
    from trainer.sharded_checkpoint import remove_directory_checkpoint

    for stale in list_checkpoints(save_dir)[keep_last:]:
        try:
            if os.path.isdir(stale):
                remove_directory_checkpoint(stale)
            else:
                os.remove(stale)
        except OSError:
            pass


REQUIRED_KEYS = ("model_config", "model", "optimizer", "step", "epoch", "samples_in_epoch", "rng", "world_size", "args")


def load_resume_checkpoint(path: str, required=REQUIRED_KEYS) -> dict:
    """Read and validate a resume checkpoint; never unpickles arbitrary objects.

    Memory-mapped: the tensors are read from the page cache when used, so the ranks of one node
    share one copy instead of each holding the whole file. `required` names the entries the
    caller needs (inference needs only the model).
    """
    if os.path.isdir(path):
        if path.rstrip("/").endswith(".dcp"):  # a sharded checkpoint (--fsdp 1)
            from trainer.sharded_checkpoint import load_meta

            return load_meta(path, required)
        raise CheckpointError(f"resume checkpoint {path} is a directory: give a step_*.pt file inside its "
                              "checkpoints/, or --from_resume 1 with --save_dir set to the run directory")
    if not os.path.isfile(path):
        raise CheckpointError(f"resume checkpoint {path} does not exist")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"resume checkpoint {path} is empty")
    # torch.save writes a zip archive (mmap-able); anything else is a raw pickle at best.
    archive = zipfile.is_zipfile(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=archive)
    except pickle.UnpicklingError as error:
        if _names_a_forbidden_object(str(error)):
            raise CheckpointError(
                f"refused to load {path}: it contains Python objects that a safe (weights_only) load does "
                "not allow; it is not a minisft checkpoint and may be malicious"
            ) from error
        raise CheckpointError(f"resume checkpoint {path} is corrupt or truncated ({_damage(error, archive)})") from error
    except Exception as error:  # noqa: BLE001 - torch raises many types for a damaged file
        raise CheckpointError(f"resume checkpoint {path} is corrupt or truncated ({_damage(error, archive)})") from error
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a minisft resume checkpoint")
    version = state.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer minisft (format version {version}; this version reads up to "
            f"{FORMAT_VERSION}): upgrade minisft to resume from it"
        )
    missing = [key for key in required if key not in state]
    if missing:
        raise CheckpointError(f"resume checkpoint {path} is incomplete (missing {', '.join(missing)})")
    return state


def _names_a_forbidden_object(message: str) -> bool:
    """Whether the weights-only unpickler stopped at a real global or reduce (a pickled object that
    would run code), not at bytes that are no pickle at all."""
    return "Weights only load failed" in message and any(
        marker in message for marker in ("GLOBAL", "REDUCE", "reduce", "Can only create new object", "Can only build"))


def _damage(error: BaseException, archive: bool) -> str:
    return _short(error) if archive else "not a torch checkpoint: no complete zip archive in it"


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160]}" if text else type(error).__name__


def find_resume_checkpoint(save_dir: str, log=print) -> tuple[str, dict] | None:
    """The newest readable checkpoint in `save_dir`; unreadable newer ones are skipped with a message.

    None when there is no checkpoint at all; a CheckpointError when there are some but none can be
    read (starting from scratch would then overwrite the run's model/)."""
    found = list_checkpoints(save_dir)
    for path in found:
        try:
            return path, load_resume_checkpoint(path)
        except CheckpointError as error:
            log(f"warning: skipping unusable checkpoint: {error}; falling back to the previous one")
    if found:
        raise CheckpointError(
            f"none of the {len(found)} resume checkpoint(s) in {checkpoints_dir(save_dir)} can be read (see the "
            f"warnings above); to go on from the last saved weights start a new run with --from_weight "
            f"{os.path.join(save_dir, 'model')} --save_dir NEW_DIR, or move the damaged checkpoints away"
        )
    return None


# --------------------------------------------------------------------------- one run per save_dir


def set_aside(save_dir: str, paths: list[str], reason: str) -> str:
    """Move `paths` (files or folders of `save_dir`) into `<save_dir>/set_aside/<time>-<reason>/`,
    keeping their relative paths; nothing is deleted. Returns that folder."""
    folder = os.path.join(save_dir, "set_aside", time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + reason)
    for path in paths:
        target = os.path.join(folder, os.path.relpath(path, save_dir))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(path, target)
    _fsync_dir(save_dir)
    return folder


def set_aside_later_checkpoints(save_dir: str, step: int, log=print) -> bool:
    """A resume to an earlier step starts a new line of training: the later checkpoints of the old
    line would outrank (and rotate away) the new ones, so they are moved aside, named, not deleted."""
    later = [path for path in list_checkpoints(save_dir) if step_of(path) > step]
    best_step = best_step_on_disk(save_dir)
    if best_step is not None and best_step > step:  # best/ of the old line: the new line keeps its own
        later.append(os.path.join(save_dir, BEST_DIR))
    if later:
        names = ", ".join(os.path.basename(path) for path in reversed(later))
        folder = set_aside(save_dir, later, f"after-step-{step}")
        log(f"resuming at step {step} while later checkpoints exist: moved {names} to {folder} "
            "(the new line of training replaces them; delete that folder when you no longer need it)")
    return bool(later)


def claim_for_fresh_run(save_dir: str, overwrite: bool, log=print) -> None:
    """Refuse to start a new run in a directory holding another run's checkpoints or model/,
    unless `overwrite`; then those (and its metrics.jsonl) are moved aside, not deleted."""
    previous = [os.path.join(save_dir, name) for name in ("checkpoints", "model", "best", "metrics.jsonl")
                if os.path.exists(os.path.join(save_dir, name))]
    if not (list_checkpoints(save_dir) or os.path.isdir(os.path.join(save_dir, "model"))):
        return
    if not overwrite:
        raise CheckpointError(
            f"--save_dir {save_dir} holds another run (checkpoints/ or model/): continue it with --from_resume 1, "
            "choose another --save_dir, or pass --overwrite 1 to start over there (its files are moved to "
            f"{os.path.join(save_dir, 'set_aside')}/)"
        )
    folder = set_aside(save_dir, previous, "overwritten")
    log(f"--overwrite 1: moved the previous run's {', '.join(os.path.basename(p) for p in previous)} to {folder}")


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


def inside_a_run_model_dir(path: str) -> str | None:
    """The `<run>/model` (or `<run>/best`) directory that `path` is or lies in (a later save replaces
    it), else None."""
    current = os.path.abspath(path)
    while True:
        parent = os.path.dirname(current)
        if os.path.basename(current) in ("model", "best") and (
                os.path.isdir(checkpoints_dir(parent)) or os.path.exists(os.path.join(parent, "metrics.jsonl"))):
            return current
        if parent == current:
            return None
        current = parent


def check_model_config(saved: dict, current) -> None:
    """Refuse a checkpoint whose architecture differs from the one the flags describe."""
    current_dict = current.to_dict()
    fields = ARCHITECTURE_FIELDS
    if not saved.get("use_moe") and not current_dict.get("use_moe"):
        fields = [name for name in fields if name not in MOE_FIELDS]
    differing = [
        f"{name} (checkpoint {saved.get(name)!r}, flags {current_dict.get(name)!r})"
        for name in fields
        if saved.get(name) != current_dict.get(name)
    ]
    if differing:
        raise CheckpointError("checkpoint model config differs from the flags: " + "; ".join(differing))
