"""Resume checkpoints of a sharded run (`--fsdp 1`), written with `torch.distributed.checkpoint`.

    checkpoints/step_00000100.dcp/     one directory per checkpoint
        __0_0.distcp, __1_0.distcp     each rank's shard of the weights and the AdamW state
        .metadata                      DCP's index of every tensor's pieces
        meta.pt                        everything else (step, epoch, every rank's RNG, args, ...),
                                       the same content as a single-file checkpoint's

Written in the background (`start_save`, DCP's `async_save`): every rank copies its shard to host
memory and the training loop goes on while a thread of each rank writes it, with DCP's
collectives on a gloo group of their own (`checkpoint_group`; the loop's collectives run on the
default group meanwhile). The next save, the end of the run and a SIGTERM wait for it
(`ShardedSave.wait`, in trainer/checkpoint/background.py's writer thread).

Atomic: all ranks write into `step_XXXXXXXX.dcp.tmp/`; once DCP's last collective has returned on
rank 0 (every rank's shard on disk and fsynced, `.metadata` written) rank 0 adds `meta.pt` and
renames the directory. A crash at any moment before the rename
leaves only a `.tmp` directory, which `save_dir.list_checkpoints` does not match and the next save deletes;
checkpoints rotated out are renamed away before they are deleted, so a half-deleted one is never
taken for a checkpoint either.

Loading reshards: a checkpoint written by N processes loads on M processes, sharded or not
(`load_training_state` works for a fully_shard-ed model and for a plain one). Every read goes through
trainer/checkpoint/dcp_reading.py, which never unpickles arbitrary objects.
"""

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.checkpoint import single_file
from trainer.checkpoint.dcp_reading import check_entries, load_quietly, read_index
from trainer.checkpoint.files import atomic_torch_save, fsync_dir, remove_stale_temporaries
from trainer.checkpoint.save_dir import (
    SHARDED_SUFFIX, checkpoint_path, checkpoints_dir, drop_old_checkpoints, remove_directory_checkpoint,
)
from trainer.errors import CheckpointError, first_line
from trainer.runtime.distributed import barrier
from trainer.runtime.groups import side_group

META = "meta.pt"
SHARDED_ENTRIES = ("model", "optimizer")  # in the shards; everything else is in meta.pt


def sharded_path(save_dir: str, step: int) -> str:
    return checkpoint_path(save_dir, step, SHARDED_SUFFIX)


def is_sharded(saved: dict) -> bool:
    return "sharded_path" in saved


def remove_stale(folder: str) -> None:
    """Directories of interrupted saves (`.dcp.tmp`) and of interrupted rotations (`.dcp.old`)."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if f"{SHARDED_SUFFIX}." in name and os.path.isdir(os.path.join(folder, name)):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def failure_line(error: BaseException) -> str:
    """One line for a failed DCP write or read: the first failing rank and its error ("rank 1: [Errno 28]
    No space left on device"), not DCP's summary of ranks and tracebacks."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = next(iter(sorted(error.failures.items())))
        return f"rank {rank}: {first_line(cause, 200)}"
    return first_line(error, 200)


def checkpoint_group():
    """The gloo group of DCP's collectives in a background write, apart from the group the training loop
    uses meanwhile (two threads' collectives on one group would interleave); collective the first time:
    every rank saves. Its timeout is torch's default for a new group, not --dist_timeout: the ranks wait
    in it for the slowest rank's disk."""
    return side_group("checkpoint")


class ShardedSave:
    """A sharded checkpoint being written in the background; `wait` finishes it."""

    def __init__(self, future, final: str, meta: dict | None, save_dir: str, keep_last: int):
        self.future, self.final, self.meta = future, final, meta
        self.save_dir, self.keep_last = save_dir, keep_last

    def wait(self) -> str | None:
        """Wait for this rank's write; rank 0 (`meta` given) then publishes the directory and rotates.
        Returns the path on rank 0, None elsewhere. A write that failed on any rank fails on every
        rank (DCP gathers the failures) with a one-line CheckpointError."""
        try:
            self.future.result()
        except (CheckpointException, OSError) as error:
            raise CheckpointError(f"could not write the sharded checkpoint {self.final}: {failure_line(error)}") from None
        if self.meta is None:
            return None
        tmp, folder = f"{self.final}.tmp", os.path.dirname(self.final)
        atomic_torch_save(single_file.stamped(self.meta), os.path.join(tmp, META))
        try:
            if os.path.exists(self.final):  # the same step saved again
                remove_directory_checkpoint(self.final)
            os.replace(tmp, self.final)
            fsync_dir(folder)
        except OSError as error:
            raise CheckpointError(f"could not publish the sharded checkpoint {self.final}: {error.strerror or error}") from error
        drop_old_checkpoints(self.save_dir, self.keep_last)
        return self.final


def start_save(content: dict, save_dir: str, keep_last: int, ctx) -> ShardedSave:
    """Every rank copies its shard to host memory and starts writing it in the background
    (collective). The returned save is finished by `wait` on every rank."""
    final = sharded_path(save_dir, content["step"])
    folder = checkpoints_dir(save_dir)
    if ctx.is_main:
        os.makedirs(folder, exist_ok=True)
        remove_stale(folder)
        remove_stale_temporaries(folder)
    barrier(ctx.device)
    try:
        # A writer of this module's own: DCP stages the shards to host memory with it, here (its `stage`,
        # which turns its copy-ahead from the device off). The writer DCP makes from a checkpoint id,
        # in its worker thread, keeps that copy-ahead: CUDA calls (the current stream, its synchronize)
        # in that thread, on its current device, GPU 0 whatever the rank's: a CUDA context on GPU 0 for
        # every other local rank, and on rank 0 a write that waits for the loop's queued work.
        writer = FileSystemWriter(f"{final}.tmp")
        future = dcp.async_save({key: content[key] for key in SHARDED_ENTRIES}, storage_writer=writer,
                                process_group=checkpoint_group())
    except (CheckpointException, OSError) as error:
        raise CheckpointError(f"could not write the sharded checkpoint {final}: {failure_line(error)}") from None
    meta = {key: value for key, value in content.items() if key not in SHARDED_ENTRIES} if ctx.is_main else None
    return ShardedSave(future, final, meta, save_dir, keep_last)


def load_meta(path: str, required) -> dict:
    """The non-tensor part of a sharded checkpoint, validated like a single-file checkpoint, plus
    `sharded_path`, once its index and shards are checked (`check_shards`). A caller that asks for the
    weights only (inference) gets them as full tensors."""
    meta_file = os.path.join(path, META)
    if not os.path.isfile(meta_file) or not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"sharded checkpoint {path} is incomplete (no {META} or .metadata)")
    check_shards(path)
    saved = single_file.load(meta_file, required=[k for k in required if k not in SHARDED_ENTRIES])
    saved["sharded_path"] = path
    if "model" in required and "optimizer" not in required:
        saved["model"] = read_full(path, "model")
    return saved


def check_shards(path: str) -> None:
    """DCP's index (`.metadata`) holds nothing but an index, every piece it lists (file, offset, length
    of each) lies within its shard file, and the shards' non-tensor entries hold plain values: an index
    or entry that would run code, or a shard cut short or missing, makes the checkpoint unusable here,
    where the newest usable one is chosen, not in the middle of the load."""
    metadata = read_index(path)
    ends = {}
    for piece in metadata.storage_data.values():
        ends[piece.relative_path] = max(ends.get(piece.relative_path, 0), piece.offset + piece.length)
    for name, end in sorted(ends.items()):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            raise CheckpointError(f"sharded checkpoint {path} is incomplete (no {name})")
        if os.path.getsize(shard) < end:
            raise CheckpointError(f"sharded checkpoint {path} is truncated ({name} holds {os.path.getsize(shard)} "
                                  f"bytes, its index needs {end})")
    check_entries(path, metadata)


def read_full(path: str, entry: str, only=None) -> dict:
    """One entry ("model") of a sharded checkpoint as full tensors, in this process alone. With `only`, just
    the tensors it names are read; the others are meta tensors of their shape and dtype (DCP's index), which
    is what a check of names and shapes (trainer/weights/read.py, `misfit`) needs."""
    prefix = f"{entry}."
    metadata = read_index(path)
    try:
        state = {
            key: torch.empty(item.size, dtype=item.properties.dtype,
                             device="meta" if only is not None and key[len(prefix):] not in only else None)
            for key, item in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
        }
        wanted = {key: value for key, value in state.items() if not value.is_meta}
        if wanted:
            load_quietly(wanted, True, path)
    except CheckpointError:
        raise
    except (CheckpointException, OSError, RuntimeError, ValueError) as error:
        raise CheckpointError(f"sharded checkpoint {path} is unreadable ({first_line(error, 200)})") from None
    return {key[len(prefix):]: value for key, value in state.items()}


def load_training_state(model, optimizer, saved: dict) -> None:
    """Load the shards into `model` and `optimizer` (fully_shard-ed or plain; any process count)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        load_quietly(state, not dist.is_initialized(), saved["sharded_path"])
    except CheckpointException as error:
        raise CheckpointError(f"sharded checkpoint {saved['sharded_path']} does not fit this run: {failure_line(error)}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
