"""Step 5: how the processes share the work. The loop talks to one of two objects with the same
small interface, so it never asks which one it has:

- `Replicated` (the default): every process holds the whole model; DDP all-reduces gradients.
- `FullyShardedParallel` (`--fsdp 1`, trainer/fsdp.py): weights, gradients and optimizer state are
  sharded over the processes with FSDP2.

The interface:
    wrap(model)                         -> the module the loop calls (DDP / fully_shard)
    micro_step(model, last)             -> context for one micro-batch's forward+backward of `model`
                                           (what wrap returned, maybe compiled); only the last
                                           micro-batch of an optimizer step communicates
    clip_grad_norm(max_norm)            -> total gradient norm (a plain tensor), gradients clipped
    training_state(optimizer)           -> {"model": ..., "optimizer": ...} for the resume checkpoint
    load_training_state(optimizer, saved)   model + optimizer from any resume checkpoint (a DDP
                                           file or a sharded directory, any number of processes)
    write_resume_checkpoint(content, save_dir, keep_last) -> path (None on ranks that wrote nothing)
    inference_model(dtype)              -> on rank 0 a plain model holding the full weights for the
                                           inference files; None elsewhere (collective)
"""

import contextlib

import torch

from trainer import checkpoint, sharded_checkpoint
from trainer.model_setup import ConfigError, wrap_for_distributed


class Replicated:
    """One process, or DDP: the whole model on every rank."""

    checkpoint_kind = "file"

    def __init__(self, ctx):
        self.ctx = ctx
        self.model = None  # the plain model; the DDP wrapper is not kept here (see train_full_sft.py, step 9)

    def wrap(self, model):
        self.model = model
        return wrap_for_distributed(model, self.ctx)

    def micro_step(self, model, last: bool):
        if last or not self.ctx.distributed:
            return contextlib.nullcontext()
        return model.no_sync()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def training_state(self, optimizer) -> dict:
        return {"model": self.model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_training_state(self, optimizer, saved: dict) -> None:
        if sharded_checkpoint.is_sharded(saved):
            sharded_checkpoint.load_training_state(self.model, optimizer, saved)
            return
        self.model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])

    def write_resume_checkpoint(self, content: dict, save_dir: str, keep_last: int) -> str | None:
        if not self.ctx.is_main:
            return None
        return checkpoint.save_resume_checkpoint(content, save_dir, keep_last)

    def inference_model(self, dtype: torch.dtype):
        return self.model if self.ctx.is_main else None


def build_parallelism(args, ctx, dtype: torch.dtype):
    """`--fsdp 1` with several processes shards the model; one process has nothing to shard."""
    if not args.fsdp or not ctx.distributed:
        return Replicated(ctx)
    if dtype == torch.float16:
        raise ConfigError("--fsdp 1 trains in float32 or bfloat16; use --dtype bfloat16 (float16 needs loss scaling)")
    from trainer.fsdp import FullyShardedParallel

    return FullyShardedParallel(ctx, dtype)
