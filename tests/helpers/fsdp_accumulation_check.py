"""Run by tests/trainer/parallel/test_fsdp_accumulation.py under torchrun (2 processes, gloo):
`fsdp_accumulation_check.py REPORT.json`.

Two optimizer steps of the loop (`take_step`, accumulation 2) on a tiny FSDP2 model
(`FullyShardedParallel`), computing in float32 and then in bfloat16. After the backward of every
micro-batch but the last, the loop's own `micro_step` context wrapped to look, each rank records the
gradients it holds: a parameter whose `.grad` is not a DTensor of the rank's shard alone (Shard(0),
local rows at most half of the parameter's, rounded up), and every unsharded gradient FSDP2 keeps
for accumulation (an FSDPParam's `unsharded_accumulated_grad`, the reduce-dtype sum of a low-precision
gradient, or the `.grad` of its unsharded parameter, where the gradient is already in reduce dtype).
Rank 0 writes both ranks' records to REPORT.json."""

import contextlib
import gc
import json
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.trainer.loop.test_loop_syncs import micro_batches, new_interval, tiny_run  # noqa: E402
from trainer.loop.loop import take_step  # noqa: E402
from trainer.parallel.fsdp import FullyShardedParallel  # noqa: E402
from trainer.runtime.distributed import DistContext  # noqa: E402
from trainer.runtime.groups import close_process_groups  # noqa: E402


def held_gradients(model, world_size: int) -> dict:
    """The parameters whose gradient is not this rank's shard alone, and FSDP2's unsharded gradients."""
    not_sharded = []
    for name, param in model.named_parameters():
        grad = param.grad
        shard_numel = math.ceil(param.shape[0] / world_size) * math.prod(param.shape[1:])
        if not (isinstance(grad, DTensor) and grad.placements == (Shard(0),)
                and grad.to_local().numel() <= shard_numel < param.numel()):
            not_sharded.append(name)
    unsharded = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in param_groups(module._get_fsdp_state()):
            for fsdp_param in group.fsdp_params:
                if fsdp_param.unsharded_accumulated_grad is not None:
                    unsharded.append(f"{fsdp_param._param_fqn}: unsharded_accumulated_grad")
                unsharded_param = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded_param is not None and unsharded_param.grad is not None:
                    unsharded.append(f"{fsdp_param._param_fqn}: unsharded_param.grad")
    return {"not_sharded": not_sharded, "unsharded": unsharded}


def param_groups(state) -> list:
    """FSDP2's parameter groups of one module's state: a list in torch 2.13, one group (or None) in 2.11."""
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def check(dtype: torch.dtype) -> list[dict]:
    """Two steps of two micro-batches; what this rank holds after each step's first micro-batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ctx = DistContext(rank, rank, world_size, torch.device("cpu"), "gloo")
    parallel = FullyShardedParallel(ctx, dtype)
    run = tiny_run(ctx.device, parallel=parallel, ctx=ctx, dtype=dtype)
    records, real_micro_step = [], parallel.micro_step

    @contextlib.contextmanager
    def micro_step(model, last: bool):
        with real_micro_step(model, last):
            yield
        if not last:
            records.append(held_gradients(parallel.model, world_size))

    parallel.micro_step = micro_step
    interval = new_interval(run)
    for step in range(2):
        take_step(run, micro_batches(2 * step + rank), interval, 1e-3)
    return records


def main(report: str) -> None:
    dist.init_process_group("gloo")
    records = {str(dtype).removeprefix("torch."): check(dtype) for dtype in (torch.float32, torch.bfloat16)}
    gc.collect()  # the models go before the process group: FSDP2's hooks hold reference cycles
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        with open(report, "w", encoding="utf-8") as handle:
            json.dump(gathered, handle)
    dist.barrier()
    close_process_groups()


if __name__ == "__main__":
    main(*sys.argv[1:])
