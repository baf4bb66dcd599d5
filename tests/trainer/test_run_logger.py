"""trainer/run_logger.py: what rank 0 sends to wandb (offline, in-process)."""

import sys
from types import SimpleNamespace

import pytest

from trainer.run_logger import RunLogger


def figures(loss):
    return {"loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0, "skipped_steps": 0}


def test_wandb_keeps_every_row_after_a_resume_to_an_earlier_step(tmp_path, monkeypatch):
    """A run logs steps 1-4 and crashes; its last checkpoint is of step 2, so the resumed run (the
    same wandb run) logs steps 3-5 again. wandb drops a row whose `step=` is below the last one it
    got; every row must reach it, each with the training step as its x-axis value."""
    wandb = pytest.importorskip("wandb")  # in requirements.txt; absent where torch came without it

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sent, defined = [], []
    log, define_metric = wandb.Run.log, wandb.Run.define_metric

    def record_log(self, data, step=None, commit=None):
        sent.append((self.id, dict(data), step))
        return log(self, data, step=step, commit=commit)

    def record_define_metric(self, name, step_metric=None, **kwargs):
        defined.append((name, step_metric))
        return define_metric(self, name, step_metric=step_metric, **kwargs)

    monkeypatch.setattr(wandb.Run, "log", record_log)
    monkeypatch.setattr(wandb.Run, "define_metric", record_define_metric)
    args = SimpleNamespace(save_dir=str(tmp_path), use_wandb=1, wandb_project="minisft-test", wandb_run_name=None)

    first = RunLogger(args, is_main=True)
    for step in (1, 2, 3, 4):
        first.log_train(step, 5, 0, 1, figures(10.0 - step), eta_s=0)
    first.log_eval(4, {"eval_loss": 6.5})
    first.finish(exit_code=1)  # the crash
    resumed = RunLogger(args, is_main=True, wandb_run_id=first.wandb_run_id)
    for step in (3, 4, 5):
        resumed.log_train(step, 5, 0, 1, figures(20.0 - step), eta_s=0)
    resumed.finish()

    assert {run_id for run_id, _, _ in sent} == {first.wandb_run_id}  # one wandb run, continued
    explicit = [step for _, _, step in sent if step is not None]
    assert explicit == sorted(explicit), f"wandb drops the rows whose step goes back: steps {explicit}"
    assert [(row["train/step"], row.get("loss", row.get("eval_loss"))) for _, row, _ in sent] == [
        (1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (4, 6.5), (3, 17.0), (4, 16.0), (5, 15.0)]
    assert ("train/step", None) in defined and ("*", "train/step") in defined
    assert defined.count(("*", "train/step")) == 2  # the resumed process plots against the training step too


@pytest.fixture(autouse=True)
def _no_wandb_run_left():
    yield
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()


def test_the_first_loss_after_a_resume_says_it_averages_only_the_steps_since(data, tmp_path):
    import json
    import os

    from tests.helpers.trainer_launch import flags, run_trainer_in_process

    run = tmp_path / "run"  # one-process runs checked by their lines and metrics: main() in this process
    common = ["--batch_size", "8", "--log_interval", "4"]
    run_trainer_in_process(flags(data, run, *common, "--max_steps", "3"), check=True)  # a checkpoint of step 3
    resumed = run_trainer_in_process(flags(data, run, *common, "--max_steps", "8", "--from_resume", "1"), check=True)
    lines = [line for line in resumed.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["4/8", "8/8"]
    assert lines[0].endswith(" | loss over 1 step since the resume at step 3")
    assert "since the resume" not in lines[1]
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"), encoding="utf-8")]
    after = [row for row in rows if row["kind"] == "train" and row["step"] > 3]
    assert (after[0]["step"], after[0]["resumed_at_step"], after[0]["loss_steps"]) == (4, 3, 1)
    assert "resumed_at_step" not in after[1] and "loss_steps" not in after[1]


def test_use_wandb_without_wandb_installed_is_one_line_before_the_data_is_read(data, tmp_path, monkeypatch):
    import shutil

    from tests.helpers.trainer_launch import flags, run_trainer_in_process

    shutil.copy(data / "train.jsonl", tmp_path / "train.jsonl")
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ModuleNotFoundError, as uninstalled
    monkeypatch.setenv("WANDB_MODE", "offline")  # no login needed: only the missing package is refused
    result = run_trainer_in_process(flags(tmp_path, tmp_path / "run", "--max_steps", "1", "--use_wandb", "1"))
    assert (result.returncode, result.stderr) == (2, "error: --use_wandb 1: wandb is not installed (pip install wandb)\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run", "train.jsonl"]  # nothing tokenized


def test_the_eval_lines_follow_the_held_out_files_in_the_order_given(tmp_path, capsys):
    """--eval_data_path zeta.jsonl,alpha.jsonl: the overall line, then zeta's, then alpha's (the order of
    the evaluation's figures), not sorted by name."""
    logger = RunLogger(SimpleNamespace(save_dir=str(tmp_path), use_wandb=0), is_main=True)
    logger.log_eval(4, {"eval_loss": 2.0, "eval_loss/zeta": 1.5, "eval_loss/alpha": 2.5})
    assert capsys.readouterr().out.splitlines() == [
        "eval step 4 | eval_loss 2.0000", "eval step 4 [zeta] | eval_loss 1.5000", "eval step 4 [alpha] | eval_loss 2.5000"]
