"""Step 5: how the processes share the work. The loop talks to one of two objects with the same
small interface, so it never asks which one it has:

- `Replicated` (the default, ddp.py): every process holds the whole model; DDP all-reduces gradients.
- `FullyShardedParallel` (`--fsdp 1`, fsdp.py): weights, gradients and optimizer state are
  sharded over the processes with FSDP2.

The interface:
    wrap(model)                         -> the module the loop calls (DDP / fully_shard)
    micro_step(model, last)             -> context for one micro-batch's forward+backward of `model`
                                           (what wrap returned, maybe compiled): DDP communicates
                                           on the last micro-batch of an optimizer step only, FSDP
                                           on every one (its gradients accumulate sharded)
    settle_layout(backward_of_zero)     before the first step: runs `backward_of_zero` (a forward and
                                           backward of zero) where the wrapper's gradient layout settles
                                           at its first backward (DDP), so every step is summed alike
    clip_grad_norm(max_norm)            -> total gradient norm (a plain tensor), gradients clipped
    training_state(optimizer)           -> {"model": ..., "optimizer": ...} for the resume checkpoint
    load_training_state(optimizer, saved)   model + optimizer from any resume checkpoint (a DDP
                                           file or a sharded directory, any number of processes)
    write_resume_checkpoint(content, save_dir, keep_last) -> "file": the path on rank 0 (None on ranks
                                           that wrote nothing), called in the writer thread with the
                                           host copy; "sharded": every rank starts writing its shard in
                                           the background and gets a ShardedSave (its wait() gives that)
    inference_model(dtype)              -> on rank 0 a plain model holding the full weights for the
                                           inference files; None elsewhere (collective)
"""

from typing import Protocol

import torch

from trainer.errors import ConfigError
from trainer.parallel.ddp import Replicated
from trainer.parallel.fsdp import FullyShardedParallel


class Parallelism(Protocol):
    """What the loop asks of the way the processes share the model (see above)."""

    checkpoint_kind: str  # "file" (step_*.pt) or "sharded" (step_*.dcp/)
    model: torch.nn.Module | None  # the plain model (after wrap)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module: ...
    def micro_step(self, model: torch.nn.Module, last: bool): ...
    def settle_layout(self, backward_of_zero) -> None: ...
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor: ...
    def training_state(self, optimizer: torch.optim.Optimizer) -> dict: ...
    def load_training_state(self, optimizer: torch.optim.Optimizer, saved: dict) -> None: ...
    def write_resume_checkpoint(self, content: dict, save_dir: str, keep_last: int): ...
    def inference_model(self, dtype: torch.dtype) -> torch.nn.Module | None: ...


def build_parallelism(args, ctx, dtype: torch.dtype) -> Parallelism:
    """`--fsdp 1` with several processes shards the model; one process has nothing to shard."""
    if not args.fsdp or not ctx.distributed:
        return Replicated(ctx)
    if dtype == torch.float16:
        raise ConfigError("--fsdp 1 trains in float32 or bfloat16, not float16 (it needs loss scaling; --dtype auto "
                          "picks it on a GPU without native bf16): use --dtype bfloat16 on a GPU with compute "
                          "capability 8.0 or newer, --dtype float32 on an older one")
    return FullyShardedParallel(ctx, dtype)
