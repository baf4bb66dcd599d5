"""Run by tests/trainer/loop/test_loop_syncs.py under torchrun (2 processes, gloo):
`step_reads_check.py ddp|fsdp REPORT.json`.

Three optimizer steps of the loop (`take_step`) on a tiny model, DDP or FSDP2, the second with a
NaN loss, each under `HostReads`; then a log line. Rank 0 writes what it saw to REPORT.json, with
the model FLOPs of the log window."""

import datetime
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from scripts._host_reads import HostReads  # noqa: E402
from tests.trainer.loop.test_loop_syncs import micro_batches, new_interval, poisoned, tiny_run  # noqa: E402
from trainer.loop import loop  # noqa: E402
from trainer.loop.loop import log_interval, take_step  # noqa: E402
from trainer.parallel.ddp import Replicated  # noqa: E402
from trainer.parallel.fsdp import FullyShardedParallel  # noqa: E402
from trainer.runtime.distributed import DistContext  # noqa: E402
from trainer.runtime.groups import close_process_groups  # noqa: E402


def local_values(run) -> list[torch.Tensor]:
    values = []
    for param in run.raw_model.parameters():
        values.append(getattr(param, "_local_tensor", param).detach().clone())
        for value in run.optimizer.state.get(param, {}).values():
            values.append(getattr(value, "_local_tensor", value).detach().clone())
    return values


def check(kind: str) -> dict:
    """The three steps and the log line; what rank 0 reports."""
    rank = dist.get_rank()
    device = torch.device("cpu")
    ctx = DistContext(rank, rank, 2, device, "gloo")
    parallel = Replicated(ctx) if kind == "ddp" else FullyShardedParallel(ctx, torch.float32)
    run = tiny_run(device, parallel=parallel, ctx=ctx)
    interval = new_interval(run)
    guard = HostReads(run.model, run.optimizer)
    loop.model_inputs = guard.on_the_device(loop.model_inputs)  # marked as the device's copies
    steps = [guard.during(lambda: take_step(run, micro_batches(rank), interval, 1e-3))]
    before = local_values(run)
    with poisoned(run):
        steps.append(guard.during(lambda: take_step(run, micro_batches(2 + rank), interval, 1e-3)))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, local_values(run), strict=True))
    steps.append(guard.during(lambda: take_step(run, micro_batches(4 + rank), interval, 1e-3)))
    window_flops = interval["throughput"].flops  # both ranks' micro-batches, as the ranks agreed on them
    log_line = guard.during(lambda: log_interval(run, interval, torch.zeros(()), 1e-3, 10))
    return {"steps": steps, "log_line": log_line, "skipped_steps": run.state.skipped_steps,
            "unchanged_by_skipped_step": unchanged, "window_flops": window_flops}


def main(kind: str, report: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    result = check(kind)
    # The model and its optimizer state go before the process group, as in the trainer's step 9:
    # FSDP2's hooks hold reference cycles, and collected only at interpreter exit, after
    # destroy_process_group, they can abort the process at exit.
    gc.collect()
    if dist.get_rank() == 0:
        with open(report, "w", encoding="utf-8") as handle:
            json.dump(result, handle)
    dist.barrier()
    close_process_groups()


if __name__ == "__main__":
    main(*sys.argv[1:])
