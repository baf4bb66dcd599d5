"""The learning rate schedule of a resume: which warmup it takes and when it says the schedule changed."""

import itertools
import math

from trainer.loop.lr_schedule import (
    cosine_lr, recorded_schedule, run_warmup, schedule_change, schedule_record, unrecorded_schedule, warmup_afresh,
    warmup_too_long,
)

CHECKPOINT = schedule_record(4, 1, 1e-3, 0.1)  # the schedule a checkpoint records


def test_a_resume_keeps_its_runs_warmup_unless_the_flag_gives_one_or_nothing_was_trained():
    assert run_warmup(None, CHECKPOINT, 2, 100) == (1, "the warmup of 1 step of the checkpoint's schedule")
    assert run_warmup(7, CHECKPOINT, 2, 100) == (7, "--warmup_steps 7")
    assert run_warmup(None, CHECKPOINT, 0, 100) == (3, "the warmup of 3 steps")  # a step-0 checkpoint trained nothing
    assert run_warmup(None, None, 2, 100) == (3, "the warmup of 3 steps")  # a checkpoint that records no schedule


def test_a_warmup_longer_than_the_run_is_said_in_the_singular_where_it_is_one_step():
    assert warmup_too_long(5, "--warmup_steps 5", 1, 1e-3) == (
        "warning: --warmup_steps 5 is longer than the run's 1 optimizer step: the learning rate ends at 0.0002, below "
        "--learning_rate 0.001")
    assert warmup_too_long(1, "the warmup of 1 step", 1, 1e-3) is None


def test_a_schedule_of_another_total_is_said_also_where_the_rate_at_the_checkpoints_step_is_the_same():
    # step 1 of warmup 2 trained at half the peak on both schedules; the totals differ
    line = schedule_change(1, 5e-4, schedule_record(4, 2, 1e-3, 0.1), schedule_record(50, 2, 1e-3, 0.1))
    assert line == ("note: this run's learning rate schedule (50 optimizer steps, warmup 2, peak 0.001, floor 0.0001) is "
                    "not the checkpoint's (4 optimizer steps, warmup 2, peak 0.001, floor 0.0001): its step 1 trained at "
                    "0.0005, this schedule gives 0.0005 there, and the run goes on at 0.001")
    assert schedule_change(1, 5e-4, schedule_record(50, 2, 1e-3, 0.1), schedule_record(50, 2, 1e-3, 0.1)) is None
    assert schedule_change(1, 5e-4, None, schedule_record(50, 2, 1e-3, 0.1)) is None  # unrecorded: the rate alone


def test_a_checkpoint_s_schedule_is_taken_only_where_it_is_a_schedule_record():
    """A damaged or foreign `lr_schedule` is read as none (the warmup is counted afresh), not a
    TypeError at the start of the loop."""
    assert recorded_schedule(CHECKPOINT) == CHECKPOINT
    assert recorded_schedule({**CHECKPOINT, "cycles": 2}) == CHECKPOINT  # a key of another version: left out
    for damaged in (None, "4 steps", [4, 1, 1e-3, 0.1], {**CHECKPOINT, "warmup_steps": 1.5},
                    {**CHECKPOINT, "warmup_steps": -1}, {**CHECKPOINT, "peak_lr": float("nan")},
                    {**CHECKPOINT, "total_steps": True}, {**CHECKPOINT, "total_steps": 10**400},
                    {k: v for k, v in CHECKPOINT.items() if k != "min_lr_ratio"}):
        assert recorded_schedule(damaged) is None, damaged


def test_a_checkpoint_without_a_record_gives_the_total_its_flags_counted_as_the_sampler_counts():
    """`unrecorded_schedule` counts the steps left as the loop counts them on the sampler (each process
    every world-th sample, padded; micro-batches; accumulation), for any processes and position."""
    from dataset.sampler import ResumableDistributedSampler

    for samples, world, batch, accumulation, start, epoch, epochs in itertools.product(
            (1, 7, 50), (1, 2, 3), (1, 4), (1, 3), (0, 5), (0, 1), (2, 3)):
        sampler = ResumableDistributedSampler(samples, num_replicas=world, rank=0)
        sampler.set_start_index(start)
        left = math.ceil(math.ceil(len(sampler) / batch) / accumulation)
        sampler.set_start_index(0)
        whole = math.ceil(math.ceil(len(sampler) / batch) / accumulation)
        saved = {"world_size": world, "step": 3, "epoch": epoch, "samples_in_epoch": start,
                 "args": {"batch_size": batch, "accumulation_steps": accumulation, "epochs": epochs, "max_steps": 0,
                          "warmup_steps": 0, "learning_rate": 1e-3, "min_lr_ratio": 0.1}}
        total = 3 + left + (epochs - epoch - 1) * whole
        trained = cosine_lr(2, total, 1e-3, 0, 0.1)
        assert unrecorded_schedule(saved, samples, trained) == schedule_record(total, 0, 1e-3, 0.1), saved
        saved["args"]["max_steps"] = 4  # caps the total
        capped = min(total, 4)
        assert unrecorded_schedule(saved, samples, cosine_lr(2, capped, 1e-3, 0, 0.1))["total_steps"] == capped
        assert unrecorded_schedule(saved, samples, 5e-4) is None  # the flags do not give the rate it trained at


def test_a_resume_that_counts_its_warmup_afresh_says_so_in_one_line():
    assert warmup_afresh(None, None, 2, "the warmup of 3 steps", 100) == (
        "note: the checkpoint records no learning rate schedule, nor one its flags reproduce: the warmup of 3 steps "
        "is counted afresh, from this run's 100 optimizer steps")
    for flag, resumed, step in ((7, None, 2), (None, CHECKPOINT, 2), (None, None, 0)):  # a flag, a record, no step
        assert warmup_afresh(flag, resumed, step, "the warmup of 3 steps", 100) is None
