"""Runs stopped by a signal (kill -9 of the job or of a rank, elastic restarts, SIGTERM) resume bit-identically."""

import os
import random
import re
import signal
import sys
import time
import types

import pytest

from tests.helpers.fault_checks import FINAL_STEP, ONE_PROCESS, CheckpointWatcher, temporaries
from tests.helpers.trainer_launch import (
    SCRIPT, Launcher, assert_weights_equal, checkpoint_at, clean_env, final_weights, flags, free_port, metric_rows,
    run_ranks_apart, run_trainer_in_process, torchrun_cmd, wait_until, worker_pids,
)
from trainer.checkpoint.resume import load_resume_checkpoint

pytestmark = pytest.mark.slow

# Two processes x batch 2 for 16 steps, a checkpoint every 2: room for three faulted jobs in a row
# (tests/helpers/fault_checks.py's 10 steps for the one-process runs).
LONG_TWO = ["--batch_size", "2", "--max_steps", "16", "--save_interval", "2", "--keep_last", "10"]
LONG_FINAL_STEP = 16


def test_sigkill_at_random_points_then_from_resume_is_bit_identical(data, reference, launcher, tmp_path):
    """kill -9 of the whole job: once right inside a checkpoint write, then at seeded random times."""
    rng = random.Random(20240605)
    save_dir = tmp_path / "run"
    args = flags(data, save_dir, *ONE_PROCESS, "--from_resume", "1")
    kills = ["inside a checkpoint write", "random", "random"]
    for attempt, point in enumerate(kills):
        process = launcher.start(args, f"attempt{attempt}")
        watcher = CheckpointWatcher(save_dir)
        if point == "inside a checkpoint write":
            # a .tmp file exists only while a checkpoint is being written; another one is complete
            wait_until(lambda: watcher.poll() and temporaries(save_dir), process, launcher, what="a checkpoint write")
        else:
            target, delay = metric_rows(save_dir) + rng.randint(1, 4), rng.uniform(0.0, 0.3)
            wait_until(lambda: watcher.poll() and metric_rows(save_dir) >= target, process, launcher,
                       what=f"{target} metric rows")
            time.sleep(delay)
        os.killpg(process.pid, signal.SIGKILL)
        assert launcher.wait(process) == -signal.SIGKILL
        if point == "inside a checkpoint write":
            assert temporaries(save_dir), "the kill did not land inside the write"
        watcher.assert_undamaged()
    finished = run_trainer_in_process(args, check=True)  # what the killed runs left behind is checked, not this run
    assert "resuming from" in finished.stdout
    assert temporaries(save_dir) == []  # the killed write's leftover was cleaned up
    assert load_resume_checkpoint(checkpoint_at(save_dir, FINAL_STEP))["step"] == FINAL_STEP
    assert_weights_equal(final_weights(save_dir), final_weights(reference))


@pytest.fixture(scope="module")
def reference_two(data, tmp_path_factory):
    """The uninterrupted two-process run of LONG_TWO (this module's, in place of tests/e2e/conftest.py's),
    its two ranks as two plain processes: only its weights are used."""
    save_dir = tmp_path_factory.mktemp("reference_two")
    ranks = run_ranks_apart(SCRIPT, flags(data, save_dir, *LONG_TWO), local_ranks=(0, 1))
    assert [rank.returncode for rank in ranks] == [0, 0], [rank.stderr[-3000:] for rank in ranks]
    return save_dir


@pytest.fixture(scope="module")
def faulted_two(data, tmp_path_factory):
    """One two-process run taken through three faults in turn, each job resuming what the one before
    left: kill -9 of one rank at a random time after the first checkpoint (torchrun, no restarts,
    tears down the rest); SIGTERM to all workers two steps into the resumed job; an elastic job
    (--max-restarts 2) whose worker is killed as soon as the job's first own checkpoint exists, so
    that its restart resumes from that checkpoint and finishes the run."""
    rng = random.Random(7)
    folder = tmp_path_factory.mktemp("faulted_two")
    launcher, found = Launcher(folder), types.SimpleNamespace(save_dir=folder / "run")
    args = flags(data, found.save_dir, *LONG_TWO, "--from_resume", "1")
    try:
        job = launcher.start(args, "killed_rank", nproc=2)
        watcher = CheckpointWatcher(found.save_dir)
        wait_until(watcher.poll, job, launcher, what="the first checkpoint")
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(worker_pids(job.pid)[1], signal.SIGKILL)
        found.killed_rank_code = launcher.wait(job)
        watcher.assert_undamaged()  # before any later job writes into the save_dir

        job = launcher.start(args, "sigterm", nproc=2)
        rows = metric_rows(found.save_dir)
        wait_until(lambda: metric_rows(found.save_dir) >= rows + 2, job, launcher, what="two more steps")
        for pid in worker_pids(job.pid).values():
            os.kill(pid, signal.SIGTERM)
        found.sigterm_code, (found.sigterm_out, _) = launcher.wait(job), launcher.output(job)
        found.stopped_at = int(found.sigterm_out.split("SIGTERM received: stopping at step ")[1].split()[0])

        job = launcher.start(args, "elastic", launcher=torchrun_cmd(2, "--max-restarts", "2"))
        found.killed_after = found.stopped_at + 2 - found.stopped_at % 2  # the job's first own checkpoint
        wait_until(lambda: os.path.exists(checkpoint_at(found.save_dir, found.killed_after)), job, launcher,
                   what="the elastic job's first checkpoint")
        os.kill(worker_pids(job.pid)[1], signal.SIGKILL)  # a worker, not the agent
        found.elastic_code, found.elastic_out = launcher.wait(job), launcher.output(job)
    finally:
        launcher.stop_all()
    return found


def test_torchrun_job_survives_a_killed_rank_and_a_sigterm(faulted_two, reference_two):
    """kill -9 of one rank (torchrun tears down the rest), resume; SIGTERM to all workers, resume."""
    run = faulted_two
    assert run.killed_rank_code != 0
    assert run.sigterm_code == 0
    assert "resuming from" in run.sigterm_out
    assert "stopped after SIGTERM; continue with --from_resume 1" in run.sigterm_out
    assert run.stopped_at < LONG_FINAL_STEP
    assert load_resume_checkpoint(checkpoint_at(run.save_dir, run.stopped_at))["step"] == run.stopped_at
    assert_weights_equal(final_weights(run.save_dir), final_weights(reference_two))


def test_elastic_restart_resumes_from_the_latest_checkpoint(faulted_two, reference_two):
    run = faulted_two
    assert run.elastic_code == 0, run.elastic_out
    # its first start resumes the SIGTERM's save; the restart, the checkpoint the job wrote itself
    resumed = [int(step) for step in re.findall(r"resuming from \S+ \(step (\d+)", run.elastic_out[0])]
    assert resumed[0] == run.stopped_at and resumed[-1] >= run.killed_after, resumed
    assert_weights_equal(final_weights(run.save_dir), final_weights(reference_two))


@pytest.mark.parametrize("shared_store", ["shared agent store", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"])
def test_two_node_elastic_restart_with_c10d_rendezvous(data, reference_two, launcher, tmp_path, shared_store):
    """Two torchrun agents (two "nodes" of one process each) with the c10d rendezvous, as in a
    multi-node job: a worker killed on node 1 makes both agents restart their workers (only
    node 1 counts it as a restart), and the new group resumes from the latest checkpoint."""
    save_dir, port = tmp_path / "run", free_port()
    extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if shared_store.startswith("TORCH_") else {}
    args = flags(data, save_dir, *LONG_TWO, "--from_resume", "1")
    agents = []
    for node in (0, 1):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "minisft-test",
                    "--max-restarts", "2"]
        agents.append(launcher.start(args, f"node{node}", launcher=torchrun, env=clean_env(**extra)))
    wait_until(lambda: os.path.exists(checkpoint_at(save_dir, 2)), agents[0], launcher, what="the first checkpoint")
    os.kill(next(iter(worker_pids(agents[1].pid).values())), signal.SIGKILL)
    for agent in agents:
        assert launcher.wait(agent) == 0, launcher.output(agent)
    out = launcher.output(agents[0])[0] + launcher.output(agents[1])[0]
    err = launcher.output(agents[0])[1] + launcher.output(agents[1])[1]
    assert "resuming from" in out
    # The shared store works here because the survivor's worker fails at once too (so both
    # agents count the restart); the note recommends the fresh-store setting all the same.
    assert ("warning: torchrun on several nodes with --max-restarts" in err) == (not extra)
    assert_weights_equal(final_weights(save_dir), final_weights(reference_two))


def test_sigterm_saves_and_exits_zero_with_dataloader_workers(data, reference, launcher, tmp_path):
    save_dir = tmp_path / "run"
    args = flags(data, save_dir, *ONE_PROCESS, "--from_resume", "1", "--num_workers", "2")
    process = launcher.start(args, "sigterm")
    wait_until(lambda: metric_rows(save_dir) >= 3, process, launcher, what="three steps")
    os.killpg(process.pid, signal.SIGTERM)  # the trainer and its DataLoader workers, like a scheduler does
    assert launcher.wait(process) == 0, launcher.output(process)
    out, err = launcher.output(process)
    assert "Traceback" not in err
    stopped_at = int(out.split("SIGTERM received: stopping at step ")[1].split()[0])
    assert 3 <= stopped_at < FINAL_STEP
    assert f"saved {checkpoint_at(save_dir, stopped_at)}" in out
    resumed = run_trainer_in_process(args, check=True)  # what the stopped run saved is checked, not this run
    assert f"training {FINAL_STEP} optimizer steps from step {stopped_at}" in resumed.stdout
    assert_weights_equal(final_weights(save_dir), final_weights(reference))
