"""Hangs: a peer that never joins, or dies in a collective, ends the waiting rank within its timeout."""

import os
import signal
import socket
import time

import pytest

from tests.helpers.fault_checks import last_line
from tests.helpers.trainer_launch import (
    FAULTY_TRAINER, clean_env, flags, free_port, metric_rows, run_trainer, run_trainer_in_process, wait_until,
)

pytestmark = pytest.mark.slow


def test_a_peer_that_never_arrives_fails_within_dist_timeout(data, launcher, tmp_path):
    port = free_port()
    env = clean_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    start = time.monotonic()
    process = launcher.start([*flags(data, tmp_path / "run", "--max_steps", "2"), "--dist_timeout", "1"], "alone",
                             env=env)
    assert launcher.wait(process, timeout=120) == 2
    assert time.monotonic() - start < 60
    _, err = launcher.output(process)
    assert last_line(err).startswith(
        f"error: rank 0: the 2 processes did not all join the process group at 127.0.0.1:{port} within "
        "--dist_timeout 1s (DistStoreError: Timed out after"
    )
    assert "1/2 clients joined" in last_line(err) and "Traceback" not in err


def test_a_rank_that_cannot_reach_the_rendezvous_fails_within_dist_timeout(data, tmp_path, monkeypatch):
    """Nobody listens at MASTER_ADDR:MASTER_PORT: torch's store client alone gives up only at about
    twice its timeout; the run's own wait (`wait_for_master`, whose line this is) gives up at
    --dist_timeout. No upper bound on the time is asserted: a loaded machine adds its own."""
    port = free_port()
    for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    done = run_trainer_in_process([*flags(data, tmp_path / "run", "--max_steps", "2"), "--dist_timeout", "1"])
    assert time.monotonic() - start >= 1
    assert (done.returncode, done.stderr.splitlines()) == (2, [
        f"error: rank 1: the 2 processes did not all join the process group at 127.0.0.1:{port} within "
        f"--dist_timeout 1s (TimeoutError: nothing answered at 127.0.0.1:{port} ([Errno 111] Connection refused))"])


def test_a_master_port_that_accepts_and_never_answers_fails_within_dist_timeout(data, tmp_path):
    """Something listens at MASTER_ADDR:MASTER_PORT but is no store (a listening socket that never
    accepts: the kernel completes the connection, nobody answers): torch's store client, once
    connected, waits for an answer with no timeout of its own. The run's wait gives up at
    --dist_timeout; the subprocess's timeout is the bound that a rank held forever would fail."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        env = clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        start = time.monotonic()
        done = run_trainer([*flags(data, tmp_path / "run", "--max_steps", "2"), "--dist_timeout", "1"], env=env,
                           check=False, timeout=120)
    assert time.monotonic() - start >= 1
    assert (done.returncode, done.stderr.splitlines()) == (2, [
        f"error: rank 1: the 2 processes did not all join the process group at 127.0.0.1:{port} within "
        f"--dist_timeout 1s (TimeoutError: 127.0.0.1:{port} accepts connections but does not answer as torch's "
        "store (another program on MASTER_PORT?))"])


def test_a_rank_that_dies_in_a_collective_ends_the_survivor(data, launcher, tmp_path):
    """No torchrun: nobody tears the survivor down, it must notice by itself."""
    save_dir = tmp_path / "run"
    args = [*flags(data, save_dir, "--batch_size", "2", "--max_steps", "20", "--save_interval", "0"),
            "--dist_timeout", "30"]
    port = str(free_port())
    ranks = [launcher.start(args, f"rank{rank}", env=clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                                                               MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in (0, 1)]
    wait_until(lambda: metric_rows(save_dir) >= 3, ranks[0], launcher, what="three steps")
    os.kill(ranks[1].pid, signal.SIGKILL)
    start = time.monotonic()
    assert launcher.wait(ranks[0], timeout=120) == 1
    assert time.monotonic() - start < 30 + 30
    _, err = launcher.output(ranks[0])
    assert last_line(err).startswith("error: rank 0: a peer process failed or stopped responding (RuntimeError: ")
    assert "by peer" in last_line(err) and "Traceback" not in err


def test_a_rank_that_stops_on_an_error_ends_the_survivor_at_once(data, launcher, tmp_path):
    """No torchrun: rank 1 runs out of memory at step 3 (tests/helpers/faults.py) and leaves with its
    line; its exit closes its connections, so rank 0, in that step's gradient all-reduce or the next
    step's count, fails within seconds, not after --dist_timeout."""
    args = [*flags(data, tmp_path / "run", "--batch_size", "2", "--max_steps", "20", "--save_interval", "0"),
            "--dist_timeout", "300"]
    port = str(free_port())
    ranks = [launcher.start(args, f"rank{rank}", script=FAULTY_TRAINER, env=clean_env(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        **({"MINISFT_FAULT_OOM_STEP": "3"} if rank else {}))) for rank in (0, 1)]
    assert launcher.wait(ranks[1], timeout=240) == 1
    left = time.monotonic()
    assert launcher.wait(ranks[0], timeout=240) == 1
    assert time.monotonic() - left < 30
    (_, err0), (_, err1) = launcher.output(ranks[0]), launcher.output(ranks[1])
    assert last_line(err1).startswith("error: step 3 ran out of memory on cpu (CUDA out of memory.")
    assert last_line(err0).startswith("error: rank 0: a peer process failed or stopped responding (RuntimeError: ")
    assert "by peer" in last_line(err0) and "Traceback" not in err0 + err1
