"""What a resume takes from its flags and what from its checkpoint: the optimizer's settings."""

import json
import math
import shutil

import pytest
import torch

from tests.helpers.trainer_launch import TINY, checkpoint_at, flags, run_trainer_in_process
from trainer.loop import loop

DEFAULT_WARMUP = [*TINY[:TINY.index("--warmup_steps")], *TINY[TINY.index("--warmup_steps") + 2:]]  # 3% of the steps


def stop_after_step(monkeypatch, step: int) -> None:
    """The next run in this process stops after `step` as after a SIGTERM, with a resume checkpoint."""
    agree = loop.agree_on_step

    def sigterm_after(run, *rest, **kwargs):
        if run.state.step == step:
            run.preemption.requested, run.preemption.reason = True, "SIGTERM"
        return agree(run, *rest, **kwargs)

    monkeypatch.setattr(loop, "agree_on_step", sigterm_after)

def test_a_resume_trains_with_its_own_weight_decay(data, tmp_path):
    """--weight_decay on a resume acts from the first resumed step, as --learning_rate does; the
    checkpoint's optimizer groups (the run that wrote it) do not keep theirs."""
    first = tmp_path / "first"
    run_trainer_in_process(flags(data, first, "--batch_size", "8", "--max_steps", "2", "--weight_decay", "0.01"),
                           check=True)
    same = tmp_path / "same"
    shutil.copytree(first, same)
    for folder, decay in ((first, "0.5"), (same, "0.01")):
        run_trainer_in_process(flags(data, folder, "--batch_size", "8", "--max_steps", "3", "--weight_decay", decay,
                                     "--from_resume", "1"), check=True)
    start = torch.load(checkpoint_at(first, 2), weights_only=True)["model"]
    changed, kept = (torch.load(checkpoint_at(folder, 3), weights_only=True) for folder in (first, same))
    assert [group["weight_decay"] for group in changed["optimizer"]["param_groups"]] == [0.5, 0.0]
    assert [group["weight_decay"] for group in kept["optimizer"]["param_groups"]] == [0.01, 0.0]
    lr = changed["optimizer"]["param_groups"][0]["lr"]
    assert lr == kept["optimizer"]["param_groups"][0]["lr"] == 3e-3 * 3 / 10  # step 3 of warmup 10
    # AdamW decays a matrix by lr x weight_decay before its update: the two step-3 weights differ by exactly that
    for name, weight in start.items():
        difference = changed["model"][name] - kept["model"][name]
        expected = -lr * (0.5 - 0.01) * weight if weight.dim() >= 2 else torch.zeros_like(weight)
        torch.testing.assert_close(difference, expected, rtol=0, atol=1e-7, msg=name)


def test_a_resume_on_another_schedule_says_where_the_learning_rate_goes(data, tmp_path):
    """A resume with another total of optimizer steps (here --max_steps 4 -> 8: the cosine is stretched;
    another global batch or --epochs does the same) says which learning rate the checkpoint's last step
    trained at and where this schedule takes it; a resume on the same curve says nothing."""
    steps = ["--batch_size", "8", "--warmup_steps", "1", "--min_lr_ratio", "0.1"]
    first = tmp_path / "first"
    run_trainer_in_process(flags(data, first, *steps, "--max_steps", "4", "--save_interval", "3"), check=True)
    same = run_trainer_in_process(flags(data, first, *steps, "--max_steps", "4",
                                        "--resume_from", checkpoint_at(first, 3)), check=True)
    assert "schedule" not in same.stdout
    longer = run_trainer_in_process(flags(data, tmp_path / "longer", *steps, "--max_steps", "8",
                                          "--resume_from", checkpoint_at(first, 3)), check=True)
    trained = torch.load(checkpoint_at(first, 3), weights_only=True)["optimizer"]["param_groups"][0]["lr"]
    # step 3 of 4 (one warmup step, then 3 down the cosine from 3e-3 to 3e-4): a third of the way
    assert trained == pytest.approx(3e-4 + 2.7e-3 * 0.5 * (1 + math.cos(math.pi / 3)), rel=1e-12)
    there = 3e-4 + 2.7e-3 * 0.5 * (1 + math.cos(math.pi / 7))  # step 3 of 8: a seventh of the way
    next_lr = 3e-4 + 2.7e-3 * 0.5 * (1 + math.cos(2 * math.pi / 7))
    line = (f"note: this run's learning rate schedule (8 optimizer steps, warmup 1, peak 0.003, floor 0.0003) is not the "
            f"checkpoint's (4 optimizer steps, warmup 1, peak 0.003, floor 0.0003): its step 3 trained at {trained:.4g}, this schedule gives {there:.4g} there, and the run goes on at {next_lr:.4g}")
    assert line in longer.stdout.splitlines()
    last = torch.load(checkpoint_at(tmp_path / "longer", 8), weights_only=True)["optimizer"]["param_groups"][0]["lr"]
    assert last == pytest.approx(3e-4 + 2.7e-3 * 0.5 * (1 + math.cos(6 * math.pi / 7)), rel=1e-12)  # this schedule's


def test_a_resume_keeps_the_warmup_its_run_counted_at_its_first_start(data, tmp_path, monkeypatch):
    """The default warmup (3% of the run's optimizer steps) is counted at the run's first start, recorded in its
    checkpoints and kept by every resume: a resume whose total is recounted (here --max_steps 4 -> 100; another
    global batch or --epochs does the same) goes on down the cosine from the peak the checkpoint trained at, not
    into a warmup of 3 steps counted from the new total (step 2 at 2e-3, then back up to 3e-3). The note names
    both schedules, also where the rate at the checkpoint's step is the same on both."""
    default_warmup = DEFAULT_WARMUP
    args = ["--batch_size", "8", "--min_lr_ratio", "0.1", "--epochs", "10"]
    first, longer = tmp_path / "first", tmp_path / "longer"
    run_trainer_in_process([*default_warmup, "--data_path", str(data / "train.jsonl"), "--save_dir", str(first), *args,
                            "--max_steps", "4", "--save_interval", "1", "--keep_last", "4"], check=True)
    stop_after_step(monkeypatch, 3)
    resumed = run_trainer_in_process([*default_warmup, "--data_path", str(data / "train.jsonl"), "--save_dir",
                                      str(longer), *args, "--max_steps", "100", "--save_interval", "0",
                                      "--resume_from", checkpoint_at(first, 1)], check=True)
    rows = [json.loads(line) for line in open(longer / "metrics.jsonl", encoding="utf-8")]
    lrs = {row["step"]: row["lr"] for row in rows if row["kind"] == "train"}
    # one warmup step, then 99 down the cosine from 3e-3 to 3e-4: step 2 is its start, step 3 a 99th of the way
    assert lrs == {2: 3e-3, 3: pytest.approx(3e-4 + 2.7e-3 * 0.5 * (1 + math.cos(math.pi / 99)), rel=1e-12)}
    line = ("note: this run's learning rate schedule (100 optimizer steps, warmup 1, peak 0.003, floor 0.0003) is not the "
            "checkpoint's (4 optimizer steps, warmup 1, peak 0.003, floor 0.0003): its step 1 trained at 0.003, this "
            "schedule gives 0.003 there, and the run goes on at 0.003")
    assert line in resumed.stdout.splitlines()
    for folder, step, total in ((first, 1, 4), (longer, 3, 100)):
        assert torch.load(checkpoint_at(folder, step), weights_only=True)["lr_schedule"] == {
            "total_steps": total, "warmup_steps": 1, "peak_lr": 3e-3, "min_lr_ratio": 0.1}


def test_a_resume_with_another_floor_or_peak_during_the_warmup_says_so(data, tmp_path):
    """In the warmup the rate does not depend on --min_lr_ratio: a resume there with another floor trains at the
    checkpoint's rate for the rest of the warmup, and its cosine ends elsewhere; the note says so, naming both schedules."""
    first = tmp_path / "first"
    run_trainer_in_process(flags(data, first, "--batch_size", "8", "--max_steps", "4", "--save_interval", "2"),
                           check=True)
    floor = run_trainer_in_process(flags(data, tmp_path / "floor", "--batch_size", "8", "--max_steps", "4",
                                         "--min_lr_ratio", "0.5", "--resume_from", checkpoint_at(first, 2)), check=True)
    line = ("note: this run's learning rate schedule (4 optimizer steps, warmup 10, peak 0.003, floor 0.0015) is not the "
            "checkpoint's (4 optimizer steps, warmup 10, peak 0.003, floor 0.0003): its step 2 trained at 0.0006, this "
            "schedule gives 0.0006 there, and the run goes on at 0.0009")
    assert line in floor.stdout.splitlines()


def resume_without_the_record(data, tmp_path, monkeypatch, change, name: str):
    """Resume to 100 steps, stopped after step 3, from the step-2 checkpoint of a 2-step run (default warmup: 1 step)
    that `change` has edited; returns the trainer's output and the schedule its step-3 checkpoint records."""
    common = [*DEFAULT_WARMUP, "--data_path", str(data / "train.jsonl"), "--batch_size", "8", "--epochs", "10"]
    first = tmp_path / "first"
    if not first.exists():
        run_trainer_in_process([*common, "--save_dir", str(first), "--max_steps", "2"], check=True)
    saved = torch.load(checkpoint_at(first, 2), weights_only=True)
    assert saved["lr_schedule"]["warmup_steps"] == 1
    change(saved)
    torch.save(saved, tmp_path / f"{name}.pt")
    stop_after_step(monkeypatch, 3)
    done = run_trainer_in_process([*common, "--save_dir", str(tmp_path / name), "--max_steps", "100",
                                   "--save_interval", "0", "--resume_from", str(tmp_path / f"{name}.pt")], check=True)
    return done.stdout, torch.load(checkpoint_at(tmp_path / name, 3), weights_only=True)["lr_schedule"]


def test_a_checkpoint_without_a_schedule_record_keeps_the_warmup_its_flags_counted(data, tmp_path, monkeypatch):
    """A checkpoint that records no schedule (no `lr_schedule`, or one damaged: read as none) gives the one its run trained on from its flags (--max_steps 2, the default warmup
    of 1 step), which reproduce the rate its last step trained at: the resume to 100 steps keeps that warmup, as
    it keeps a recorded one, where counting afresh would give 3 steps."""
    for name, change in (("unrecorded", lambda saved: saved.pop("lr_schedule")),
                         ("damaged", lambda saved: saved.update(lr_schedule="2 steps"))):
        stdout, schedule = resume_without_the_record(data, tmp_path, monkeypatch, change, name)
        assert schedule == {"total_steps": 100, "warmup_steps": 1, "peak_lr": 3e-3, "min_lr_ratio": 0.1}, name
        assert "counted afresh" not in stdout
        assert ("note: this run's learning rate schedule (100 optimizer steps, warmup 1, peak 0.003, floor 0.0003) is "
                "not the checkpoint's (2 optimizer steps, warmup 1, peak 0.003, floor 0.0003)") in stdout, name


def test_a_checkpoint_whose_flags_give_no_schedule_resumes_with_the_warmup_counted_afresh_and_says_so(
        data, tmp_path, monkeypatch):
    """No record, and flags whose schedule is not the one the checkpoint's last step trained at (here its rate is
    edited): the warmup is 3% of this run's 100 steps, said in one line."""
    def change(saved):
        del saved["lr_schedule"]
        for group in saved["optimizer"]["param_groups"]:
            group["lr"] = 1e-3

    stdout, schedule = resume_without_the_record(data, tmp_path, monkeypatch, change, "afresh")
    assert schedule == {"total_steps": 100, "warmup_steps": 3, "peak_lr": 3e-3, "min_lr_ratio": 0.1}
    assert ("note: the checkpoint records no learning rate schedule, nor one its flags reproduce: the warmup of 3 "
            "steps is counted afresh, from this run's 100 optimizer steps") in stdout.splitlines()
