"""The token cache build's worker processes (dataset/cache/workers.py), with real processes and
real signals: results in order, a worker's error raised with its traceback, workers that a
signal to the group does not kill, a worker killed mid-send that cannot hang the parent."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from dataset.cache.workers import RemoteTraceback, WorkerDied, WorkerPool
from tests.helpers.trainer_launch import REPO

FORK = "fork" in mp.get_all_start_methods()


def square_or_fail(task):
    kind, value = task
    if kind == "fail":
        raise ValueError(f"bad task {value}")
    if kind == "big":
        return bytes(value)  # larger than a pipe's buffer: the worker blocks in send until it is read
    if kind == "pid":
        return os.getpid()
    return value * value


@pytest.fixture(params=["fork", "spawn"] if FORK else ["spawn"])
def pool(request):
    pool = WorkerPool(square_or_fail, 3, context=mp.get_context(request.param), what="the test")
    yield pool
    pool.close()


def test_results_come_in_order_whatever_order_they_are_asked_for(pool):
    assert list(pool.imap((("sq", i) for i in range(50)), window=4)) == [i * i for i in range(50)]
    pending = [pool.submit(("sq", i)) for i in range(10)]
    assert [p.get() for p in reversed(pending)] == [i * i for i in reversed(range(10))]


def test_an_error_in_a_worker_is_raised_with_the_worker_s_traceback(pool):
    first, failing, last = pool.submit(("sq", 2)), pool.submit(("fail", 7)), pool.submit(("sq", 3))
    with pytest.raises(ValueError, match="^bad task 7$") as info:
        failing.get()
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "square_or_fail" in str(info.value.__cause__)
    assert (first.get(), last.get()) == (4, 9)  # the pool goes on


@pytest.mark.skipif(not FORK, reason="needs fork")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_to_a_worker_does_not_kill_it(signum):
    """Stopping is the parent's decision: a group's SIGTERM used to kill workers wherever they were,
    also while one held multiprocessing.Pool's shared result lock, and Pool.terminate() then waited
    on that lock forever (1 run in 10 of the build's group-signal test)."""
    pool = WorkerPool(square_or_fail, 2, context=mp.get_context("fork"))
    try:
        pids = [pool.submit(("pid", 0)).get(), pool.submit(("pid", 0)).get()]
        for pid in pids:
            os.kill(pid, signum)
        time.sleep(0.3)
        assert list(pool.imap(("sq", i) for i in range(6))) == [0, 1, 4, 9, 16, 25]
        assert [pool.submit(("pid", 0)).get(), pool.submit(("pid", 0)).get()] == pids
    finally:
        pool.close()


@pytest.mark.skipif(not FORK, reason="needs fork")
def test_a_worker_killed_while_it_sends_is_reported_and_close_returns():
    pool = WorkerPool(square_or_fail, 2, context=mp.get_context("fork"), what="the test")
    try:
        worker_pid = pool.submit(("pid", 0)).get()  # task 0 went to worker 0
        pool.submit(("sq", 1)).get()
        big = pool.submit(("big", 8 << 20))  # worker 0: stuck in send, nobody reads yet
        time.sleep(0.5)
        os.kill(worker_pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match=rf"^a worker process of the test \(pid {worker_pid}\) was killed by "
                                             r"SIGKILL \(out of memory\?\); run the same command again$"):
            big.get()
    finally:
        started = time.monotonic()
        pool.close()
    assert time.monotonic() - started < 10


@pytest.mark.skipif(not FORK, reason="needs fork")
def test_close_kills_busy_workers():
    pool = WorkerPool(square_or_fail, 2, context=mp.get_context("fork"))
    processes = list(pool._processes)
    for _ in range(4):
        pool.submit(("big", 8 << 20))  # both workers blocked in send
    time.sleep(0.3)
    pool.close()
    assert [p.exitcode for p in processes] == [-signal.SIGKILL, -signal.SIGKILL]


@pytest.mark.skipif(not FORK, reason="needs fork")
def test_workers_of_a_parent_killed_with_sigkill_exit():
    """A trainer killed with kill -9 leaves no tokenizer workers behind: their task pipes end."""
    code = ("import multiprocessing as mp, os; from tests.dataset.test_worker_pool import square_or_fail; "
            "from dataset.cache.workers import WorkerPool; "
            "pool = WorkerPool(square_or_fail, 2, context=mp.get_context('fork')); "
            "print(*(p.pid for p in pool._processes), flush=True); os._exit(0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    pids = [int(pid) for pid in result.stdout.split()]
    assert len(pids) == 2, result.stderr
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]
              for pid in pids):
        assert time.monotonic() < deadline, "the orphaned workers still run"
        time.sleep(0.05)
