"""The float16 loss scale in the loop (trainer/loop/loop.py: optimizer_step), on the CPU: torch's
GradScaler and fused AdamW take the same path there as on a GPU (CPU autocast runs float16)."""

import torch

from scripts._host_reads import HostReads
from tests.trainer.loop.test_loop_syncs import micro_batches, new_interval, poisoned, snapshot, tiny_run
from trainer.loop.loop import settle, take_step
from trainer.runtime.precision import INITIAL_LOSS_SCALE


def test_a_loss_scale_collapsed_by_intermittent_overflows_restarts_at_the_next_finite_step():
    """Overflowing steps that never come --max_bad_steps in a row halve the scale at each one, and
    GradScaler grows it back by one doubling per 2000 finite steps: below 1 (2**-16 after 32 such
    steps) the float16 gradients underflow, nearly all of them to zero, and the run would go on
    updating with them. A finite step after the collapse restarts the scale at 65536, as a resume
    does (`scaler_state_for_resume`); the non-finite steps keep the collapsed scale, so a streak is
    counted by --max_bad_steps; nothing is read on the host."""
    run = tiny_run(torch.device("cpu"), dtype=torch.float16, max_bad_steps=5)
    interval = new_interval(run)
    take_step(run, micro_batches(0), interval, 1e-3)
    run.scaler.update(1.0)  # as after 16 overflowing steps
    guard = HostReads(run.model, run.optimizer)
    with poisoned(run):
        for seed in (1, 2, 3):
            assert guard.during(lambda: take_step(run, micro_batches(seed), interval, 1e-3)) == []
    assert run.scaler.get_scale() == 0.125
    settle(run)
    assert (run.state.skipped_steps, run.state.bad_steps_in_a_row) == (3, 3)
    before = snapshot(run)
    assert guard.during(lambda: take_step(run, micro_batches(4), interval, 1e-3)) == []
    assert not torch.equal(before["w.model.embed_tokens.weight"], snapshot(run)["w.model.embed_tokens.weight"])
    assert run.scaler.get_scale() == INITIAL_LOSS_SCALE
    assert run.scaler.state_dict()["_growth_tracker"] == 0
    settle(run)
    assert (run.state.skipped_steps, run.state.bad_steps_in_a_row) == (3, 0)
