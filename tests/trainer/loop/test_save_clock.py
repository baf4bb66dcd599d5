"""--save_every_minutes (trainer/loop/save_clock.py): rank 0's clock decides, the decision travels
in the step's agreement (`agree_on_step`), and a save by steps or by time starts the next interval."""

import os

import pytest

from tests.helpers.ticking_clock import ticking_save_clock
from tests.helpers.trainer_launch import REPO, clean_env, flags, run_trainer, run_trainer_in_process
from trainer.loop import loop
from trainer.loop.loop import agree_on_step
from trainer.loop.save_clock import SaveClock
from tests.trainer.loop.test_loop_syncs import micro_batches, tiny_run


class FakeClock:
    def __init__(self):
        self.now, self.readings = 0.0, 0

    def __call__(self) -> float:
        self.readings += 1
        return self.now


def test_a_save_is_due_minutes_after_the_last_saves_decision():
    clock = FakeClock()
    timer = SaveClock(minutes=0.5, clock=clock)
    decisions = []
    for now in (10, 29.9, 30, 31, 55, 60, 61):
        clock.now = now
        decisions.append(timer.due())
        if decisions[-1]:
            timer.saved()
    assert decisions == [False, False, True, False, False, True, False]
    clock.now = 80  # a save by steps at 80 starts the next half minute there
    assert not timer.due()
    timer.saved()
    clock.now = 109.9
    assert not timer.due()
    clock.now = 110
    assert timer.due()


def test_off_or_on_another_rank_the_clock_is_never_read():
    clock = FakeClock()
    timer = SaveClock(minutes=0.0, clock=clock)
    clock.now = 10**9
    assert not timer.due() and clock.readings == 0


def test_the_decision_travels_in_the_steps_agreement():
    import torch

    run = tiny_run(torch.device("cpu"))
    assert agree_on_step(run, micro_batches(0), save_due=True).save
    assert not agree_on_step(run, micro_batches(0)).save


def checkpoint_steps(save_dir) -> list[int]:
    return sorted(int(name[5:13]) for name in os.listdir(save_dir / "checkpoints"))


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_saves_fall_on_the_steps_rank_zeros_clock_says(data, tmp_path, monkeypatch, nproc):
    """A clock of 10 s per step and --save_every_minutes 0.5: a save every third step, and the one of
    --save_interval 4 restarts the half minute; with 2 processes rank 1's clock (1000x faster) is not
    the one that decides, and both ranks save at the same steps (else a save's collectives hang).
    One process runs in the test's own (its clock is rank 0's), two under torchrun."""
    save_dir = tmp_path / "run"
    argv = flags(data, save_dir, "--batch_size", str(4 // nproc), "--max_steps", "10", "--keep_last", "10",
                 "--save_interval", "4", "--save_every_minutes", "0.5")
    if nproc == 1:
        monkeypatch.setattr(loop, "SaveClock", ticking_save_clock(10.0))
        run_trainer_in_process(argv, check=True)
    else:
        helper = os.path.join(REPO, "tests", "helpers", "ticking_clock.py")
        run_trainer(argv, nproc=nproc, script=helper, env=clean_env(MINISFT_TEST_TICK_S="10"), timeout=600)
    assert checkpoint_steps(save_dir) == [3, 4, 7, 8, 10]
