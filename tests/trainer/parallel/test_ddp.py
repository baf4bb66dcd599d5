"""trainer/parallel/ddp.py: DDP walks the autograd graph for unused parameters only where a
parameter can be unused (an MoE expert that no token of a micro-batch was routed to)."""

import datetime

import pytest
import torch
import torch.distributed as dist

from tests.helpers.trainer_launch import free_port
from tests.model.test_model import tiny_model
from trainer.parallel.ddp import wrap_for_distributed
from trainer.runtime.distributed import DistContext


@pytest.fixture
def one_process_group():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("use_moe", [False, True])
def test_only_moe_makes_ddp_look_for_unused_parameters(one_process_group, use_moe):
    ctx = DistContext(0, 0, 2, torch.device("cpu"), "gloo")  # as a rank of a 2-process run
    model = tiny_model(**(dict(use_moe=True, num_experts=4, num_experts_per_tok=1) if use_moe else {}))
    wrapped = wrap_for_distributed(model, ctx)
    assert wrapped.find_unused_parameters is use_moe
    del wrapped
