"""trainer/parallel/ddp.py: DDP never walks the autograd graph for unused parameters, since every
parameter, an MoE expert that no token reached included, gets a gradient in every backward; every
step of every run sums the gradients in DDP's settled bucket layout, so a resumed run on three or
more ranks ends bit-identical to an unbroken one."""

import datetime
import json
import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers.trainer_launch import (
    REPO, assert_weights_equal, checkpoint_at, final_weights, flags, free_port, run_ranks_apart, run_trainer,
)
from tests.helpers.tiny_model import tiny_model
from trainer.parallel.ddp import wrap_for_distributed
from trainer.runtime.distributed import DistContext


@pytest.fixture
def one_process_group():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("use_moe", [False, True])
def test_ddp_does_not_look_for_unused_parameters(one_process_group, use_moe):
    ctx = DistContext(0, 0, 2, torch.device("cpu"), "gloo")  # as a rank of a 2-process run
    model = tiny_model(**(dict(use_moe=True, num_experts=4, num_experts_per_tok=1) if use_moe else {}))
    wrapped = wrap_for_distributed(model, ctx)
    assert wrapped.find_unused_parameters is False
    del wrapped


def test_ddp_times_no_iteration_after_its_first_ten(one_process_group):
    """DDP's runtime statistics wait on the host for CUDA events of the iteration they time: the
    first 10 iterations are timed whatever the rate, no later one (by default the 100th, 200th...)."""
    ctx = DistContext(0, 0, 2, torch.device("cpu"), "gloo")
    wrapped = wrap_for_distributed(tiny_model(), ctx)
    ids = torch.randint(3, 97, (2, 8))
    for _ in range(101):
        wrapped(ids, labels=ids).loss.backward()
    assert wrapped._get_ddp_logging_data()["iteration"] == 10  # the last timed one; by default the 100th
    del wrapped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_expert_no_token_reached_still_gets_a_zero_gradient(dtype):
    """What DDP without find_unused_parameters needs: every parameter has a gradient after each
    backward. Router logits (a, 0, 0, -a) with top-1: every token goes to expert 0 or 3, so
    experts 1 and 2 get no rows."""
    model = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=1).train()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate[1:3] = 0
            gate[3] = -gate[0]
    ids = torch.randint(3, 90, (2, 12))
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = model(ids, labels=ids)
        (out.loss + out.aux_loss).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert experts[0].down_proj.weight.grad.abs().sum() + experts[3].down_proj.weight.grad.abs().sum() > 0
        for expert in experts[1:3]:
            assert all(torch.count_nonzero(p.grad) == 0 for p in expert.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_gloo_ranks_train_a_moe_whose_experts_get_no_token_on_a_rank_as_one_process_does(dtype):
    """tests/helpers/moe_ddp_check.py: three steps on two real gloo ranks through the trainer's DDP
    wrapper (no search for unused parameters). Rank 0 routes every token to expert 0, rank 1 to
    experts 0 and 1, neither to 2 or 3: the run ends, both ranks hold the same weights, those of one
    process on both ranks' batches, and the experts no token reached are unchanged."""
    ranks = run_ranks_apart(os.path.join(REPO, "tests", "helpers", "moe_ddp_check.py"), [dtype], local_ranks=(0, 1),
                            timeout=180)
    assert [rank.returncode for rank in ranks] == [0, 0], [rank.stderr[-3000:] for rank in ranks]
    report = json.loads(ranks[0].stdout.strip().splitlines()[-1])
    on_rank_0, on_rank_1 = report["routed"]
    assert len(on_rank_0) == len(on_rank_1) == 3
    assert all(counts[0] == 24 and counts[1:] == [0, 0, 0] for counts in on_rank_0), on_rank_0
    assert all(counts[0] > 0 and counts[1] > 0 and counts[2:] == [0, 0] for counts in on_rank_1), on_rank_1
    assert report["ranks_equal"] and report["unrouted_experts_unchanged"] and report["expert_1_trained"], report
    assert report["largest_difference_from_one_process"] < 1e-6, report


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--packing", "1", "--accumulation_steps", "2"),
                                   ("--use_moe", "1", "--num_experts", "4", "--num_experts_per_tok", "2",
                                    "--aux_loss_coef", "0.1")], ids=["dense", "packed", "moe"])
def test_three_ranks_resumed_mid_run_end_bit_identical_to_an_unbroken_run(data, tmp_path, extra):
    # A new DDP lays its gradient buckets out in parameter order and, after its first backward, in the
    # order the gradients became ready. On three ranks the ring's sums depend on where each element
    # lies, so a resumed run whose first step summed in the first layout would differ from the run that
    # summed that step in the settled one.
    args = ("--batch_size", "2", "--max_steps", "4", "--save_interval", "2", *extra)
    unbroken, resumed = tmp_path / "unbroken", tmp_path / "resumed"
    run_trainer(flags(data, unbroken, *args), nproc=3)
    run_trainer(flags(data, resumed, *args, "--resume_from", checkpoint_at(unbroken, 2)), nproc=3)
    assert_weights_equal(final_weights(resumed), final_weights(unbroken))
