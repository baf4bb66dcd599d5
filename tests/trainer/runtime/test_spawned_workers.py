"""trainer/runtime/distributed.py:spawn_local_workers (`--world_size N` without a launcher): a bug
in a worker keeps its traceback, on stderr, as one process would show it; a user's error is one line."""

from tests.helpers.trainer_launch import TINY, run_trainer
from trainer.runtime.distributed import spawn_local_workers


def failing_entry(argv) -> int:
    """A worker's entry with a bug in it (spawned workers import it from this module)."""
    raise ValueError(f"a bug in the worker, argv {argv}")


def test_a_bug_in_a_spawned_worker_keeps_its_traceback_on_stderr(capfd):
    assert spawn_local_workers(failing_entry, ["--flag"], 2) == 1
    out, err = capfd.readouterr()
    assert "error: a worker failed" not in out
    assert "\nerror: a worker failed\n" in "\n" + err, err
    assert "Traceback (most recent call last):" in err, err
    assert 'in failing_entry\n    raise ValueError(f"a bug in the worker, argv {argv}")' in err, err
    assert "ValueError: a bug in the worker, argv ['--flag']" in err, err


def test_a_worker_error_under_world_size_is_the_only_line_on_stderr(tmp_path):
    # torch's warning for the worker it stops after the other failed is not a second line
    missing = tmp_path / "missing.jsonl"
    done = run_trainer([*TINY, "--world_size", "2", "--data_path", str(missing), "--save_dir", str(tmp_path / "run")],
                       check=False, timeout=120)
    assert (done.returncode, done.stderr.splitlines()) == (2, [f"error: {missing}: data file not found"])
