"""Steps 3 and 7: resume checkpoints (`lm_checkpoint`) and inference weights.

Layout under `--save_dir`:
    checkpoints/step_00000100.pt   resume state (one file, `torch.load(weights_only=True)`)
    checkpoints/step_00000100.dcp/ the same, sharded (`--fsdp 1`; trainer/sharded_checkpoint.py)
    model/                         inference weights: config.json, model.safetensors
                                   (`--save_dtype`) and the tokenizer; a standard Qwen3 /
                                   Qwen3-MoE directory (trainer/weights_io.py)

Every file is written to a temporary name, fsynced and renamed, so a crash or a full disk in
the middle of a save never damages the checkpoint that was already there. Temporary files that a
killed process left behind are removed by the next save.
"""

import os
import pickle
import re
import shutil

import torch
from safetensors import SafetensorError

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


def save_inference_weights(model, tokenizer, save_dir: str, dtype: torch.dtype) -> str:
    """Write `<save_dir>/model/` (an HF directory) atomically; return its path."""
    final = os.path.join(save_dir, "model")
    tmp, old = os.path.join(save_dir, ".model.tmp"), os.path.join(save_dir, ".model.old")
    if os.path.isdir(old) and not os.path.exists(final):  # a crash between the two renames below
        os.replace(old, final)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        from trainer.weights_io import write_inference_dir

        write_inference_dir(model, tmp, dtype)
        tokenizer.save_pretrained(tmp)
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as handle:
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

    `required` names the entries the caller needs (inference needs only the model).
    """
    if os.path.isdir(path):
        from trainer.sharded_checkpoint import load_meta

        return load_meta(path, required)
    if not os.path.isfile(path):
        raise CheckpointError(f"resume checkpoint {path} does not exist")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"resume checkpoint {path} is empty")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" in str(error):
            raise CheckpointError(
                f"refused to load {path}: it contains Python objects that a safe (weights_only) load does "
                "not allow; it is not a minisft checkpoint and may be malicious"
            ) from error
        raise CheckpointError(f"resume checkpoint {path} is corrupt or truncated ({_short(error)})") from error
    except Exception as error:  # noqa: BLE001 - torch raises many types for a damaged file
        raise CheckpointError(f"resume checkpoint {path} is corrupt or truncated ({_short(error)})") from error
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


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160]}" if text else type(error).__name__


def find_resume_checkpoint(save_dir: str, log=print) -> tuple[str, dict] | None:
    """The newest readable checkpoint in `save_dir`; unreadable newer ones are skipped with a message."""
    for path in list_checkpoints(save_dir):
        try:
            return path, load_resume_checkpoint(path)
        except CheckpointError as error:
            log(f"warning: skipping unusable checkpoint: {error}; falling back to the previous one")
    return None


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
