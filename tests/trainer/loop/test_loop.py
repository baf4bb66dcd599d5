"""trainer/loop/loop.py: the run's total optimizer steps, counted before the first step."""

import json
import time
from types import SimpleNamespace

import pytest

from dataset.sampler import ResumableDistributedSampler
from tests.helpers.trainer_launch import flags, run_trainer_in_process
from trainer.loop import loop
from trainer.loop.loop import count_total_steps


def run_at(epoch: int, samples_in_epoch: int, step: int, epochs: int, max_steps: int = 0):
    """A run of 1,000 samples over 2 ranks, batch 4, 3 micro-batches per step: 42 steps a full epoch
    (500 samples per rank, 125 micro-batches), resumed at `epoch`, `samples_in_epoch`, `step`."""
    sampler = ResumableDistributedSampler(1000, num_replicas=2, rank=1, seed=7)
    args = SimpleNamespace(epochs=epochs, max_steps=max_steps, batch_size=4, accumulation_steps=3)
    state = SimpleNamespace(epoch=epoch, samples_in_epoch=samples_in_epoch, step=step)
    return SimpleNamespace(args=args, state=state, data=SimpleNamespace(sampler=sampler))


@pytest.mark.parametrize("epochs", [1, 3, 10**12])
def test_the_total_counts_the_rest_of_this_epoch_and_every_later_one(epochs):
    assert count_total_steps(run_at(0, 0, 0, epochs)) == 42 * epochs
    # resumed in epoch 1 after 600 of its samples (300 a rank: 75 micro-batches, 25 steps): 17 steps left in it
    assert count_total_steps(run_at(1, 600, 67, max(epochs, 2))) == 67 + 17 + 42 * (max(epochs, 2) - 2)
    assert count_total_steps(run_at(0, 0, 0, epochs, max_steps=50)) == min(42 * epochs, 50)


def test_the_step_that_ends_an_epoch_is_logged_as_of_that_epoch(data, tmp_path):
    run = tmp_path / "run"
    done = run_trainer_in_process(flags(data, run, "--batch_size", "32", "--epochs", "2", "--log_interval", "1",
                                        "--save_interval", "0"), check=True)  # 96 rows: 3 steps an epoch
    rows = [json.loads(line) for line in open(run / "metrics.jsonl", encoding="utf-8")]
    assert [(row["step"], row["epoch"]) for row in rows if row.get("kind") == "train"] == [
        (1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 1)]
    assert "step 3/6 (epoch 1/2) |" in done.stdout and "step 4/6 (epoch 2/2) |" in done.stdout


def test_an_epoch_that_ends_in_a_shorter_accumulation_says_so(data, tmp_path):
    def start_line(*extra):
        done = run_trainer_in_process(flags(data, tmp_path / "_".join(extra), "--max_steps", "1", "--save_interval", "0",
                                            *extra), check=True)
        return next(line for line in done.stdout.splitlines() if line.startswith("training "))

    # 96 rows: 12 micro-batches of 8 an epoch, in steps of 5, 5 and 2
    assert start_line("--batch_size", "8", "--accumulation_steps", "5").endswith(
        "x batch 8 x accumulation 5, dtype float32, device cpu; each epoch's last step accumulates 2 of 5 micro-batches")
    assert start_line("--batch_size", "8", "--accumulation_steps", "4") == (
        "training 1 optimizer step from step 0: 1 process x batch 8 x accumulation 4, dtype float32, device cpu")


def test_max_steps_beyond_the_epochs_says_where_the_run_ends(data, tmp_path):
    done = run_trainer_in_process(flags(data, tmp_path / "run", "--batch_size", "32", "--max_steps", "100",
                                        "--save_interval", "0"), check=True)  # 96 rows: 3 steps an epoch
    assert [line for line in done.stdout.splitlines() if line.startswith("warning: --max_steps")] == [
        "warning: --max_steps 100 is more than the 3 optimizer steps of --epochs 1: the run ends at step 3 "
        "(raise --epochs to train longer)"]
    assert "training 3 optimizer steps from step 0" in done.stdout


def test_tokens_per_s_leaves_out_the_time_of_evaluations_and_saves(data, tmp_path, monkeypatch):
    """Every evaluation and save takes a million seconds on the loop's clock: a window's tokens/s is
    its training tokens over its training time, so each window still shows thousands of tokens a second."""
    offset = [0.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(time=lambda: time.time() + offset[0]))

    def slow(call):
        def wrapped(*args, **kwargs):
            offset[0] += 1e6
            return call(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(loop, "evaluate", slow(loop.evaluate))
    monkeypatch.setattr(loop, "save_in_background", slow(loop.save_in_background))
    run = tmp_path / "run"
    run_trainer_in_process(flags(data, run, "--batch_size", "8", "--max_steps", "6", "--log_interval", "2",
                                 "--eval_data_path", str(data / "eval.jsonl"), "--eval_interval", "2",
                                 "--save_interval", "3"), check=True)
    rows = [json.loads(line) for line in open(run / "metrics.jsonl", encoding="utf-8")]
    speeds = {row["step"]: row["tokens_per_s"] for row in rows if row["kind"] == "train"}
    assert sorted(speeds) == [2, 4, 6] and min(speeds.values()) > 100, speeds  # their time counted in: under 0.01 after step 2


@pytest.mark.parametrize("pause", [("--save_interval", "3"), ("--eval_interval", "3", "--save_interval", "0")],
                         ids=["save", "evaluation"])
def test_the_steps_a_gpu_still_runs_when_a_pause_starts_count_as_training(data, tmp_path, monkeypatch, pause):
    """A GPU as the loop's clock sees one: the host queues a step and moves on, and the device's work
    is done at the next wait for it (`wait_for_device`, or a host read of a device value: `settle`).
    Step 3 queues a million seconds of work, and a save or an evaluation follows it between the log
    lines of steps 2 and 4: those seconds are training, in the window of step 4, not the pause's."""
    offset, queued = [0.0], [0.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(time=lambda: time.time() + offset[0]))

    def device_done(*_):
        offset[0], queued[0] = offset[0] + queued[0], 0.0

    step, settle = loop.optimizer_step, loop.settle

    def queued_step(run, *args, **kwargs):
        result = step(run, *args, **kwargs)
        queued[0] += 1e6 if run.state.step == 2 else 0.0  # step 3 (the count goes up after the step)
        return result

    def settle_after_the_device(run, *args, **kwargs):
        device_done()
        return settle(run, *args, **kwargs)

    monkeypatch.setattr(loop, "optimizer_step", queued_step)
    monkeypatch.setattr(loop, "settle", settle_after_the_device)
    monkeypatch.setattr(loop, "wait_for_device", device_done, raising=False)
    run = tmp_path / "run"
    run_trainer_in_process(flags(data, run, "--batch_size", "8", "--max_steps", "4", "--log_interval", "2",
                                 "--eval_data_path", str(data / "eval.jsonl"), "--eval_interval", "0", *pause),
                           check=True)
    rows = [json.loads(line) for line in open(run / "metrics.jsonl", encoding="utf-8")]
    speeds = {row["step"]: row["tokens_per_s"] for row in rows if row["kind"] == "train"}
    assert sorted(speeds) == [2, 4] and speeds[2] > 100, speeds
    assert speeds[4] < 0.01, speeds  # 2 steps of 8 rows, under 1,600 real tokens, over more than a million seconds


def test_the_first_step_of_a_process_is_left_out_of_the_first_windows_throughput_and_the_eta(data, tmp_path,
                                                                                            monkeypatch):
    """The first step takes a million seconds on the loop's clock (as a compilation can take
    minutes): the first line's tokens/s and the ETA are of the steps after it, and the row says how
    long the first step took; a window of the first step alone keeps it (nothing else to count)."""
    offset = [0.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(time=lambda: time.time() + offset[0]))
    agree = loop.agree_on_step

    def slow_first_step(run, *args, **kwargs):
        if run.state.step == 0:
            offset[0] += 1e6
        return agree(run, *args, **kwargs)

    monkeypatch.setattr(loop, "agree_on_step", slow_first_step)

    def first_row(name, *extra):
        done = run_trainer_in_process(flags(data, tmp_path / name, "--batch_size", "8", "--max_steps", "4",
                                            "--save_interval", "0", *extra), check=True)
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl", encoding="utf-8")]
        return next(row for row in rows if row["kind"] == "train"), done.stdout

    row, stdout = first_row("windows_of_2", "--log_interval", "2")
    assert row["step"] == 2 and row["first_step_s"] >= 1e6 and row["tokens_per_s"] > 100, row
    assert "step 2/4 (epoch 1/1) |" in stdout and "| eta 0m" in stdout.split("step 2/4", 1)[1].splitlines()[0]
    row, stdout = first_row("windows_of_1", "--log_interval", "1")
    assert row["step"] == 1 and "first_step_s" not in row and 0 < row["tokens_per_s"] < 1, row
    assert "| eta 0m" in stdout.split("step 2/4", 1)[1].splitlines()[0]  # the ETAs after it leave it out

    def sigterm_during_step_2(run, *args, **kwargs):
        if run.state.step == 1:
            run.preemption.requested, run.preemption.reason = True, "SIGTERM"
        return slow_first_step(run, *args, **kwargs)

    monkeypatch.setattr(loop, "agree_on_step", sigterm_during_step_2)  # the window of --log_interval 2 cut at 1
    row, _ = first_row("stopped_after_1", "--log_interval", "2")
    assert row["step"] == 1 and "first_step_s" not in row and 0 < row["tokens_per_s"] < 1, row


def test_a_stop_between_log_lines_logs_the_steps_since_the_last_one(data, tmp_path, monkeypatch):
    """A SIGTERM during step 5 of --log_interval 4: the run stops after step 5 and saves it; step 5's
    loss is logged (its resume logs from step 6 on), the same as a run of --log_interval 1 logs it."""
    agree = loop.agree_on_step

    def sigterm_during_step_5(run, *args, **kwargs):
        if run.state.step == 5:
            run.preemption.requested, run.preemption.reason = True, "SIGTERM"
        return agree(run, *args, **kwargs)

    def train_rows(name, *extra):
        run_trainer_in_process(flags(data, tmp_path / name, "--batch_size", "8", "--max_steps", "8",
                                     "--save_interval", "0", *extra), check=True)
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl", encoding="utf-8")]
        return {row["step"]: row for row in rows if row["kind"] == "train"}

    every = train_rows("every", "--log_interval", "1")
    monkeypatch.setattr(loop, "agree_on_step", sigterm_during_step_5)
    stopped = train_rows("stopped", "--log_interval", "4")
    assert sorted(stopped) == [4, 5]
    assert stopped[5]["loss"] == pytest.approx(every[5]["loss"], abs=1e-6)
    assert stopped[5]["lr"] == every[5]["lr"] and stopped[5]["grad_norm"] == pytest.approx(every[5]["grad_norm"])


def test_an_early_stop_between_log_lines_logs_its_steps_without_the_evaluations_time(data, tmp_path, monkeypatch):
    """--keep_best says stop at the evaluation of step 3 (--log_interval 4), which takes a million
    seconds on the loop's clock: steps 1-3 are logged, at training speed."""
    offset = [0.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(time=lambda: time.time() + offset[0]))
    evaluate = loop.evaluate

    def slow_evaluate(run):
        offset[0] += 1e6
        return evaluate(run)

    monkeypatch.setattr(loop, "evaluate", slow_evaluate)
    select = loop.update_selection
    monkeypatch.setattr(loop, "update_selection", lambda *args: (select(*args)[0], True))  # stop at the first
    run = tmp_path / "run"
    run_trainer_in_process(flags(data, run, "--batch_size", "8", "--max_steps", "8", "--log_interval", "4",
                                 "--eval_data_path", str(data / "eval.jsonl"), "--eval_interval", "3",
                                 "--keep_best", "eval_loss", "--save_interval", "0"), check=True)
    rows = [json.loads(line) for line in open(run / "metrics.jsonl", encoding="utf-8")]
    assert [(row["kind"], row["step"]) for row in rows] == [("eval", 3), ("early_stop", 3), ("train", 3)]
    assert rows[-1]["tokens_per_s"] > 100


@pytest.mark.parametrize("max_steps", [4, 5], ids=["evaluation at the last step", "evaluation after the loop"])
def test_patience_spent_at_the_last_evaluation_of_a_finished_run_stops_nothing(data, tmp_path, monkeypatch, max_steps):
    """--early_stop_patience is spent at the run's last evaluation (step 4 of 4: in the loop; step 5
    of 5: the evaluation after it): the run ends as finished, without an early-stop line or row."""
    select = loop.update_selection

    def spent_at_the_end(state, *args):
        new_best, _ = select(state, *args)
        return new_best, state.step == max_steps

    monkeypatch.setattr(loop, "update_selection", spent_at_the_end)
    run = tmp_path / "run"
    done = run_trainer_in_process(flags(data, run, "--batch_size", "8", "--max_steps", str(max_steps), "--log_interval",
                                        "2", "--eval_data_path", str(data / "eval.jsonl"), "--eval_interval", "2",
                                        "--keep_best", "eval_loss", "--early_stop_patience", "3",
                                        "--save_interval", "0"), check=True)
    rows = [json.loads(line) for line in open(run / "metrics.jsonl", encoding="utf-8")]
    assert [row["step"] for row in rows if row["kind"] == "eval"][-1] == max_steps
    assert not [row for row in rows if row["kind"] == "early_stop"]
    assert "early stop" not in done.stdout and "stopped early" not in done.stdout
    assert done.stdout.splitlines()[-1].startswith("done: the model is in ")
