"""Run by tests/trainer/runtime/test_teardown.py: `teardown_check.py STORE REPORT.json`.

One gloo process opens what a run opens beside its default group (the host-values group of an NCCL
run, the sharded checkpoints' group) and uses a DTensor on a device mesh as FSDP2 does (a sharded
tensor replicated, its norm), drops its own references, and calls the trainer's `cleanup`. REPORT.json:
the process's thread names after the script dropped its references, then after `cleanup`."""

import datetime
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.threads_at_exit import thread_names  # noqa: E402
from trainer.checkpoint.sharded import checkpoint_group  # noqa: E402
from trainer.runtime import distributed, groups  # noqa: E402


def main(store: str, report: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    groups.open_host_group("nccl", datetime.timedelta(seconds=60))
    checkpoint_group()
    mesh = init_device_mesh("cpu", (1,))
    sharded = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    replicated = (sharded * 2).redistribute(mesh, [Replicate()])
    assert torch.linalg.vector_norm(replicated).full_tensor().item() > 0
    del mesh, sharded, replicated
    gc.collect()
    held = thread_names()
    distributed.cleanup(distributed.DistContext(0, 0, 1, torch.device("cpu"), "gloo"))
    gc.collect()
    with open(report, "w", encoding="utf-8") as handle:
        json.dump({"before": held, "after": thread_names()}, handle)


if __name__ == "__main__":
    main(*sys.argv[1:])
