"""Fault injection on the real trainer (CPU, gloo, real processes): kill -9, elastic restarts,
SIGTERM, corrupt or foreign files, non-finite losses, hangs, a full or unwritable disk, and
malicious pickles. Nothing that was saved is lost, and every resume ends bit-identical to a run
that was never interrupted. docs/reliability.md maps each fault to its test."""

import ast
import hashlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.malicious_pickle import malicious_checkpoint
from tests.helpers.trainer_launch import (
    REPO, SCRIPT, assert_weights_equal, checkpoint_at, clean_env, final_weights, flags, free_port, run_trainer,
    torchrun_cmd,
)
from trainer.checkpoint.resume import load_resume_checkpoint

pytestmark = pytest.mark.slow

FAULTY_TRAINER = os.path.join(REPO, "tests", "helpers", "faults.py")  # the trainer with MINISFT_FAULT_* planted

# One process x batch 4, and two processes x batch 2: 10 optimizer steps, a checkpoint every 2.
ONE_PROCESS = ["--batch_size", "4", "--max_steps", "10", "--save_interval", "2", "--keep_last", "10"]
TWO_PROCESSES = ["--batch_size", "2", "--max_steps", "10", "--save_interval", "2", "--keep_last", "10"]
FINAL_STEP = 10


# --------------------------------------------------------------------------- helpers


class Launcher:
    """Starts trainer processes in their own session (so a signal can reach a whole job) and
    kills whatever is still running when the test ends."""

    def __init__(self, folder):
        self.folder = folder
        self.processes = []

    def start(self, args, name, nproc=1, launcher=None, env=None) -> subprocess.Popen:
        if launcher is None:
            launcher = [sys.executable] if nproc == 1 else torchrun_cmd(nproc)
        with open(self.folder / f"{name}.out", "w") as out, open(self.folder / f"{name}.err", "w") as err:
            process = subprocess.Popen([*launcher, SCRIPT, *args], cwd=REPO, env=env or clean_env(), stdout=out,
                                       stderr=err, start_new_session=True)
        process.name = name
        self.processes.append(process)
        return process

    def output(self, process) -> tuple[str, str]:
        return ((self.folder / f"{process.name}.out").read_text(), (self.folder / f"{process.name}.err").read_text())

    def wait(self, process, timeout=180) -> int:
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{process.name} still running after {timeout}s: {self.output(process)}") from None

    def stop_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.fixture
def launcher(tmp_path):
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.stop_all()


def wait_until(condition, process, launcher, timeout=120.0, what="the condition"):
    """Poll `condition` every few milliseconds; fail if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if process.poll() is not None:
            raise AssertionError(f"{process.name} exited ({process.returncode}) before {what}: {launcher.output(process)}")
        time.sleep(0.002)
    raise AssertionError(f"timed out waiting for {what}: {launcher.output(process)}")


def metric_rows(save_dir) -> int:
    try:
        with open(os.path.join(save_dir, "metrics.jsonl"), encoding="utf-8") as handle:
            return sum(1 for _ in handle)
    except FileNotFoundError:
        return 0


def checkpoint_names(save_dir) -> list[str]:
    folder = os.path.join(save_dir, "checkpoints")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def temporaries(save_dir) -> list[str]:
    return [name for name in checkpoint_names(save_dir) if ".tmp." in name]


def digest(path) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


class CheckpointWatcher:
    """Records the bytes of every complete checkpoint as soon as it appears (they are renamed into
    place whole), to prove afterwards that no fault damaged them."""

    def __init__(self, save_dir):
        self.save_dir = save_dir
        self.seen: dict[str, str] = {}

    def poll(self) -> int:
        for name in checkpoint_names(self.save_dir):
            if name.endswith(".pt") and name not in self.seen:
                self.seen[name] = digest(os.path.join(self.save_dir, "checkpoints", name))
        return len(self.seen)

    def assert_undamaged(self) -> None:
        assert self.seen, "no checkpoint existed before the fault"
        for name, before in self.seen.items():
            path = os.path.join(self.save_dir, "checkpoints", name)
            assert digest(path) == before, f"{name} changed"
            assert load_resume_checkpoint(path)["step"] == int(name[5:13])


def worker_pids(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of the trainer processes that a torchrun agent started."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            if parent != agent_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as handle:
                variables = handle.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        for variable in variables:
            if variable.startswith(b"RANK="):
                found[int(variable[5:])] = int(entry)
    return found


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def all_finite(state) -> bool:
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(all_finite(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return all(all_finite(value) for value in state)
    return True


# --------------------------------------------------------------------------- uninterrupted runs


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("reference_one")
    run_trainer(flags(data, save_dir, *ONE_PROCESS))
    return save_dir


@pytest.fixture(scope="module")
def reference_two(data, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("reference_two")
    run_trainer(flags(data, save_dir, *TWO_PROCESSES), nproc=2)
    return save_dir


# --------------------------------------------------------------------------- kill -9


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
    finished = run_trainer(args)
    assert "resuming from" in finished.stdout
    assert temporaries(save_dir) == []  # the killed write's leftover was cleaned up
    assert load_resume_checkpoint(checkpoint_at(save_dir, FINAL_STEP))["step"] == FINAL_STEP
    assert_weights_equal(final_weights(save_dir), final_weights(reference))


def test_torchrun_job_survives_a_killed_rank_and_a_sigterm(data, reference_two, launcher, tmp_path):
    """kill -9 of one rank (torchrun tears down the rest), resume; SIGTERM to all workers, resume."""
    rng = random.Random(7)
    save_dir = tmp_path / "run"
    args = flags(data, save_dir, *TWO_PROCESSES, "--from_resume", "1")

    job = launcher.start(args, "killed_rank", nproc=2)
    watcher = CheckpointWatcher(save_dir)
    wait_until(watcher.poll, job, launcher, what="the first checkpoint")
    time.sleep(rng.uniform(0.0, 0.3))
    os.kill(worker_pids(job.pid)[1], signal.SIGKILL)
    assert launcher.wait(job) != 0
    watcher.assert_undamaged()

    job = launcher.start(args, "sigterm", nproc=2)
    rows = metric_rows(save_dir)
    wait_until(lambda: metric_rows(save_dir) >= rows + 2, job, launcher, what="two more steps")
    for pid in worker_pids(job.pid).values():
        os.kill(pid, signal.SIGTERM)
    assert launcher.wait(job) == 0
    out, _ = launcher.output(job)
    assert "resuming from" in out and "stopped after SIGTERM; continue with --from_resume 1" in out
    stopped_at = int(out.split("SIGTERM received: stopping at step ")[1].split()[0])
    assert stopped_at < FINAL_STEP
    assert load_resume_checkpoint(checkpoint_at(save_dir, stopped_at))["step"] == stopped_at

    run_trainer(args, nproc=2)
    assert_weights_equal(final_weights(save_dir), final_weights(reference_two))


def test_elastic_restart_resumes_from_the_latest_checkpoint(data, reference_two, launcher, tmp_path):
    save_dir = tmp_path / "run"
    job = launcher.start(flags(data, save_dir, *TWO_PROCESSES, "--from_resume", "1"), "elastic",
                         launcher=torchrun_cmd(2, "--max-restarts", "2"))
    wait_until(lambda: os.path.exists(checkpoint_at(save_dir, 2)), job, launcher, what="the first checkpoint")
    os.kill(worker_pids(job.pid)[1], signal.SIGKILL)  # a worker, not the agent
    assert launcher.wait(job) == 0, launcher.output(job)
    out, _ = launcher.output(job)
    assert "resuming from" in out
    assert_weights_equal(final_weights(save_dir), final_weights(reference_two))


@pytest.mark.parametrize("shared_store", ["shared agent store", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"])
def test_two_node_elastic_restart_with_c10d_rendezvous(data, reference_two, launcher, tmp_path, shared_store):
    """Two torchrun agents (two "nodes" of one process each) with the c10d rendezvous, as in a
    multi-node job: a worker killed on node 1 makes both agents restart their workers (only
    node 1 counts it as a restart), and the new group resumes from the latest checkpoint."""
    save_dir, port = tmp_path / "run", free_port()
    extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if shared_store.startswith("TORCH_") else {}
    args = flags(data, save_dir, *TWO_PROCESSES, "--from_resume", "1")
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


# --------------------------------------------------------------------------- SIGTERM


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
    resumed = run_trainer(args)
    assert f"training {FINAL_STEP} optimizer steps from step {stopped_at}" in resumed.stdout
    assert_weights_equal(final_weights(save_dir), final_weights(reference))


# --------------------------------------------------------------------------- corrupt or foreign files


def test_unusable_resume_files_give_a_one_line_error(data, reference, launcher, tmp_path):
    good = checkpoint_at(reference, 2)
    content = open(good, "rb").read()
    (tmp_path / "truncated.pt").write_bytes(content[: len(content) // 2])
    (tmp_path / "zeros.pt").write_bytes(bytes(len(content)))
    newer = torch.load(good, weights_only=True)
    newer["format_version"] = 2
    torch.save(newer, tmp_path / "newer.pt")
    marker = tmp_path / "code_ran"
    malicious_checkpoint(tmp_path / "malicious.pt", marker)
    cases = {
        "truncated": ([], f"error: resume checkpoint {tmp_path / 'truncated.pt'} is corrupt or truncated ("),
        "zeros": ([], f"error: resume checkpoint {tmp_path / 'zeros.pt'} is corrupt or truncated ("),
        "newer": ([], f"error: {tmp_path / 'newer.pt'} was written by a newer minisft (format version 2; this "
                      "version reads up to 1): upgrade minisft to resume from it"),
        "malicious": ([], f"error: refused to load {tmp_path / 'malicious.pt'}: it contains Python objects that a "
                          "safe (weights_only) load does not allow; it is not a minisft checkpoint and may be "
                          "malicious"),
        "other_config": (["--hidden_size", "64"], "error: checkpoint model config differs from the flags: "
                         "hidden_size (checkpoint 32, flags 64); head_dim (checkpoint 8, flags 16); "
                         "intermediate_size (checkpoint 128, flags 256)"),
    }
    processes = {}
    for name, (extra, _) in cases.items():  # all at once: each fails before training starts
        resume_file = good if name == "other_config" else tmp_path / f"{name}.pt"
        args = [*flags(data, tmp_path / f"run_{name}", "--max_steps", "12"), *extra, "--resume_from", str(resume_file)]
        processes[name] = launcher.start(args, name)
    for name, (_, expected) in cases.items():
        assert launcher.wait(processes[name]) == 2, launcher.output(processes[name])
        out, err = launcher.output(processes[name])
        line = last_line(err)
        assert line.startswith(expected) if expected.endswith("(") else line == expected, (name, line)
        assert "Traceback" not in err and "training" not in out
    assert not marker.exists()


def test_from_resume_falls_back_past_unusable_latest_checkpoints(data, reference, tmp_path):
    save_dir = tmp_path / "run"
    os.makedirs(save_dir / "checkpoints")
    valid = checkpoint_at(reference, 6)
    content = open(valid, "rb").read()
    open(checkpoint_at(save_dir, 6), "wb").write(content)
    open(checkpoint_at(save_dir, 8), "wb").write(open(checkpoint_at(reference, 8), "rb").read()[:1000])
    open(checkpoint_at(save_dir, 9), "wb").write(bytes(len(content)))
    marker = tmp_path / "code_ran"
    malicious_checkpoint(checkpoint_at(save_dir, 10), marker)

    result = run_trainer(flags(data, save_dir, *ONE_PROCESS, "--from_resume", "1"))
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 3
    assert warnings[0] == (
        f"warning: skipping unusable checkpoint: refused to load {checkpoint_at(save_dir, 10)}: it contains Python "
        "objects that a safe (weights_only) load does not allow; it is not a minisft checkpoint and may be malicious; "
        "falling back to the previous one"
    )
    for line, step in zip(warnings[1:], (9, 8)):
        assert line.startswith(f"warning: skipping unusable checkpoint: resume checkpoint {checkpoint_at(save_dir, step)} "
                               "is corrupt or truncated (")
        assert line.endswith("; falling back to the previous one")
    assert f"resuming from {checkpoint_at(save_dir, 6)} (step 6" in result.stdout
    assert not marker.exists()
    assert_weights_equal(final_weights(save_dir), final_weights(reference))


def test_no_code_path_unpickles_untrusted_data():
    """Every torch.load passes weights_only=True; no np.load allows pickles; no pickle.load at all."""
    problems = []
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and name not in ("out", "venv")]
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
                keywords = {k.arg: k.value for k in node.keywords}
                where = f"{os.path.relpath(path, REPO)}:{node.lineno}"
                if owner == "torch" and node.func.attr == "load":
                    flag = keywords.get("weights_only")
                    if not (isinstance(flag, ast.Constant) and flag.value is True):
                        problems.append(f"{where}: torch.load without weights_only=True")
                if owner in ("np", "numpy") and node.func.attr == "load":
                    flag = keywords.get("allow_pickle")
                    if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False):
                        problems.append(f"{where}: np.load with allow_pickle")
                if owner == "pickle" and node.func.attr in ("load", "loads"):
                    problems.append(f"{where}: pickle.{node.func.attr}")
    assert problems == []


# --------------------------------------------------------------------------- non-finite loss


def test_non_finite_steps_are_skipped_and_too_many_in_a_row_stop_the_run(data, tmp_path):
    save_dir = tmp_path / "run"
    env = clean_env(MINISFT_FAULT_NAN_STEPS="2,4,5,6")
    result = run_trainer(flags(data, save_dir, "--batch_size", "4", "--max_steps", "10", "--save_interval", "1",
                               "--keep_last", "20", "--max_bad_steps", "3"), script=FAULTY_TRAINER, env=env,
                         check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    assert last_line(result.stderr) == (
        f"error: 3 optimizer steps in a row had a non-finite loss or gradient norm (last at step 6); stopped. "
        f"The last good weights are saved in {save_dir}"
    )
    assert "Traceback" not in result.stderr
    assert ("warning: step 2 had a non-finite loss or gradient norm: optimizer step skipped (1 in a row, 1 in total)"
            in result.stdout)
    saved = {step: load_resume_checkpoint(checkpoint_at(save_dir, step)) for step in range(1, 7)}
    # an isolated bad step: neither the weights nor the optimizer moved, and training went on
    assert_weights_equal(saved[2]["model"], saved[1]["model"])
    assert all(torch.equal(saved[2]["optimizer"]["state"][i]["exp_avg"], saved[1]["optimizer"]["state"][i]["exp_avg"])
               for i in saved[1]["optimizer"]["state"])
    assert not torch.equal(saved[3]["model"]["lm_head.weight"], saved[2]["model"]["lm_head.weight"])
    # three in a row: the run stopped and saved the last good state (that of step 3)
    assert_weights_equal(saved[6]["model"], saved[3]["model"])
    assert saved[6]["step"] == 6 and saved[6]["skipped_steps"] == 4
    assert [saved[step]["bad_steps_in_a_row"] for step in range(1, 7)] == [0, 1, 0, 1, 2, 3]
    # the count survives a resume: two bad steps saved at step 5, one more after it stops the run
    resumed = run_trainer(flags(data, tmp_path / "resumed", "--batch_size", "4", "--max_steps", "10",
                                "--max_bad_steps", "3", "--resume_from", checkpoint_at(save_dir, 5)),
                          script=FAULTY_TRAINER, env=clean_env(MINISFT_FAULT_NAN_STEPS="6"), check=False)
    assert resumed.returncode == 1 and "(last at step 6)" in last_line(resumed.stderr), resumed.stderr[-2000:]
    assert not os.path.exists(checkpoint_at(save_dir, 7))
    rows = {row["step"]: row for row in map(json.loads, open(save_dir / "metrics.jsonl", encoding="utf-8"))}
    assert [rows[step]["skipped_steps"] for step in range(1, 6)] == [0, 1, 1, 2, 3]
    assert [rows[step]["loss"] is None for step in range(1, 6)] == [False, True, False, True, True]
    # no NaN in any weights file
    assert all(all_finite(state) for state in saved.values())
    assert all_finite(load_file(save_dir / "model" / "model.safetensors"))


# --------------------------------------------------------------------------- hangs


def test_a_peer_that_never_arrives_fails_within_dist_timeout(data, launcher, tmp_path):
    port = free_port()
    env = clean_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    start = time.monotonic()
    process = launcher.start([*flags(data, tmp_path / "run", "--max_steps", "2"), "--dist_timeout", "10"], "alone",
                             env=env)
    assert launcher.wait(process, timeout=120) == 2
    assert time.monotonic() - start < 60
    _, err = launcher.output(process)
    assert last_line(err).startswith(
        f"error: rank 0: the 2 processes did not all join the process group at 127.0.0.1:{port} within "
        "--dist_timeout 10s (DistStoreError: Timed out after"
    )
    assert "1/2 clients joined" in last_line(err) and "Traceback" not in err


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


# --------------------------------------------------------------------------- disk


def test_an_unwritable_save_dir_fails_before_training(data, tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    save_dir = tmp_path / "a_file" / "run"
    result = run_trainer(flags(data, save_dir, "--max_steps", "2"), check=False)
    assert result.returncode == 2
    assert last_line(result.stderr) == f"error: --save_dir {save_dir} is not writable: Not a directory"
    assert "Traceback" not in result.stderr and "training" not in result.stdout


def test_a_full_disk_fails_the_save_cleanly_and_keeps_the_previous_checkpoint(data, launcher, tmp_path):
    save_dir = tmp_path / "run"
    process = launcher.start(flags(data, save_dir, *ONE_PROCESS), "disk_full")
    first = checkpoint_at(save_dir, 2)
    # once the first save (resume checkpoint + inference weights) is complete
    wait_until(lambda: f"saved {first}" in launcher.output(process)[0], process, launcher, what="the first save")
    before = digest(first)
    limit = 256 * 1024  # well above metrics.jsonl and the logs, well below a 2.8 MB checkpoint
    resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (limit, limit))
    assert launcher.wait(process) == 2, launcher.output(process)
    out, err = launcher.output(process)
    assert last_line(err) == f"error: could not write {checkpoint_at(save_dir, 4)}: File too large"
    assert "Traceback" not in err
    assert checkpoint_names(save_dir) == ["step_00000002.pt"]  # no .tmp leftovers
    assert digest(first) == before and load_resume_checkpoint(first)["step"] == 2
    assert all_finite(load_file(save_dir / "model" / "model.safetensors"))
