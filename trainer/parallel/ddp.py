"""The default parallelism: every process holds the whole model and DDP all-reduces the gradients
(one process: the model itself). DDP ignores the RoPE tables, which every process derives alike."""


import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from model import MiniMindForCausalLM
from trainer.checkpoint import sharded, single_file

ROPE_BUFFERS = ("freqs_cos", "freqs_sin")


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

    def settle_layout(self, backward_of_zero) -> None:
        """DDP (several processes) lays its gradient buckets out in parameter order, then once more, at
        the first forward after its first backward that all-reduces, in the order the gradients became
        ready there. Where an element lies in its bucket decides how the ring all-reduce of three or more
        ranks sums it (floating-point addition is not associative), so a resumed run, whose new DDP would
        sum its first step in the first layout, would not repeat the step the unbroken run summed in the
        settled one. `backward_of_zero` (one forward and backward of the run's model, before its first
        step) settles the layout in every run; it draws no random numbers and leaves no gradient."""
        if not self.ctx.distributed:
            return
        with torch.random.fork_rng(devices=[self.ctx.device] if self.ctx.device.type == "cuda" else []):
            backward_of_zero()
        self.model.zero_grad(set_to_none=True)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def training_state(self, optimizer) -> dict:
        return {"model": self.model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_training_state(self, optimizer, saved: dict) -> None:
        if sharded.is_sharded(saved):
            sharded.load_training_state(self.model, optimizer, saved)
            return
        self.model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])

    def write_resume_checkpoint(self, content: dict, save_dir: str, keep_last: int) -> str | None:
        if not self.ctx.is_main:
            return None
        return single_file.save(content, save_dir, keep_last)

    def inference_model(self, dtype: torch.dtype):
        return self.model if self.ctx.is_main else None


RUNTIME_STATS_NEVER = 2**31 - 1  # DDP's iterations between two timed ones (an int in C++)


def wrap_for_distributed(model: MiniMindForCausalLM, ctx):
    """DDP that neither broadcasts nor syncs the RoPE tables (they are derived, identical everywhere).

    DDP matches the ignore list against fully-qualified names, e.g. `model.freqs_cos`.
    """
    if not ctx.distributed:
        return model
    ignore = [name for name, _ in model.named_buffers() if name.rsplit(".", 1)[-1] in ROPE_BUFFERS]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
    ddp = DistributedDataParallel(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        # Every parameter gets a gradient in every backward, MoE experts included: the grouped
        # dispatch (model/feed_forward.py) multiplies by all experts' weights, an expert that no
        # token reached with zero rows. So DDP skips its walk of the autograd graph for unused
        # parameters (and the host copy of their map that goes with it).
        find_unused_parameters=False,
        # After the all-reduce each parameter's .grad is a view of DDP's bucket, not a second copy
        # of every gradient beside the buckets (the model's size in fp32 less memory per rank).
        gradient_as_bucket_view=True,
    )
    # DDP times its first 10 iterations and then one in every 100 by default; on a GPU each timed
    # iteration waits on the host for the previous one's CUDA events, a host sync inside a step.
    # The largest sample rate leaves only the first 10.
    ddp._set_ddp_runtime_logging_sample_rate(RUNTIME_STATS_NEVER)
    return ddp


def unwrap(model):
    """The plain MiniMindForCausalLM behind DDP and/or torch.compile."""
    model = getattr(model, "_orig_mod", model)
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)
