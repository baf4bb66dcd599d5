"""trainer/runtime/distributed.py:spawn_local_workers (`--world_size N` without a launcher): a bug
in a worker keeps its traceback, on stderr, as one process would show it."""

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
