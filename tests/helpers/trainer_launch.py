"""Helpers for tests that run `train_full_sft.py` in real processes (python, torchrun)."""

import concurrent.futures
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import warm_start
from tests.helpers.in_process import run_in_process

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "train_full_sft.py")
FAULTY_TRAINER = os.path.join(REPO, "tests", "helpers", "faults.py")  # the trainer with MINISFT_FAULT_* planted
FORKED_LAUNCH = os.path.join(REPO, "tests", "helpers", "forked_launch.py")
# A ~30k-parameter model: every run below takes seconds on 2 CPU cores.
TINY = [
    "--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "4",
    "--num_key_value_heads", "2", "--max_seq_len", "512", "--dtype", "float32", "--log_interval", "1",
    "--learning_rate", "3e-3", "--warmup_steps", "10",
]


# The option that lets the tests see this machine's GPUs (tests/conftest.py); without it they are hidden.
GPUS_OPTION = "--gpus"


def hide_gpus(environ) -> None:
    """Hide every GPU from this process and from every process it starts (they inherit `environ`):
    the suite's runs take CPU and gloo whatever the machine has, so they behave as in CI. Only
    tests/test_cuda.py needs the GPUs; it is run on its own with GPUS_OPTION (README)."""
    environ["CUDA_VISIBLE_DEVICES"] = ""


def flags(data, save_dir, *extra) -> list[str]:
    """TINY flags on the `data` fixture's train.jsonl, saving to `save_dir`."""
    return [*TINY, "--data_path", str(data / "train.jsonl"), "--save_dir", str(save_dir), *extra]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS")}
    # PYTHONFAULTHANDLER: a process killed by a fatal signal (an abort in C++) prints its threads' Python stacks.
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **extra)
    return env


def torchrun_cmd(nproc: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *extra]


def run_trainer(args: list[str], nproc: int = 1, script: str = SCRIPT, timeout: float = 300, env=None,
                check: bool = True, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """The trainer run as `python SCRIPT ARGS`, or on `nproc` ranks by tests/helpers/forked_launch.py
    (torchrun's agent, each worker forked from the launcher), started from a process that imported the
    trainer (tests/helpers/warm_start.py); under `launcher` instead where given (torchrun_cmd, where what
    torchrun does is tested). The finished process."""
    if launcher is None:
        command = [script, *args] if nproc == 1 else [FORKED_LAUNCH, str(nproc), str(free_port()), script, *args]
        result = warm_start.run(command[0], command[1:], REPO, env or clean_env(), clean_env(), timeout)
    else:
        result = subprocess.run([*launcher, script, *args], cwd=REPO, env=env or clean_env(), capture_output=True,
                                text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"trainer failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def run_trainer_with_a_read_only(folder, argv, nproc: int = 1) -> subprocess.CompletedProcess:
    """The trainer with `argv` (under torchrun with `nproc` > 1), `folder` bind-mounted read-only in a
    private mount namespace (the test is skipped where the machine refuses one)."""
    mount = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder}"
    launcher = [sys.executable] if nproc == 1 else torchrun_cmd(nproc)
    command = after_private_mounts(mount, [*launcher, "train_full_sft.py", *argv], "a private read-only bind mount")
    return subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)


def after_private_mounts(mount: str, command: list[str], what: str) -> list[str]:
    """`command` run after the shell commands `mount`, in a private user and mount namespace of its
    own (the test is skipped, naming `what`, where the machine refuses one)."""
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", mount], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"this machine refuses {what}: {probe.stderr.strip()}")
    return ["unshare", "-Urm", "sh", "-c", f"{mount} && exec {shlex.join(command)}"]


def together(first, *others):
    """Independent runs at the same time: `first()` in this thread (a `run_trainer_in_process` run
    needs the main thread, where signal handlers are set), each of `others` in a thread of its own
    (runs that start their own processes); their results in order. An exception is raised once all
    have ended."""
    with concurrent.futures.ThreadPoolExecutor(len(others)) as pool:
        futures = [pool.submit(call) for call in others]
        result = first()  # leaving the `with` waits for the others, also after an exception
        return [result, *(future.result() for future in futures)]


def run_ranks_apart(script: str, args: list[str], local_ranks: tuple[int, int], timeout: float = 240,
                    cwds: tuple = (REPO, REPO), binds: tuple = (None, None), **env) -> list[subprocess.CompletedProcess]:
    """Two ranks of one run as two plain processes (RANK, WORLD_SIZE, LOCAL_RANK in their environment,
    no launcher), each with its own stdout and stderr; `local_ranks` (0, 0): two nodes of one process.
    `cwds`: each rank's working directory (a relative path names a folder of each "node" of its own).
    `binds`: per rank, None or (folder, path): that rank sees `folder` at `path`, bind-mounted in a
    private mount namespace (one path that holds other files on each "node"; the test is skipped
    where the machine refuses one)."""
    port = str(free_port())
    processes = []
    for rank, bind in enumerate(binds):
        environ = clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(local_ranks[rank]),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env)
        if bind is None:  # forked from a process that imported the trainer (tests/helpers/warm_start.py)
            processes.append(warm_start.start(script, args, cwds[rank], environ, clean_env()))
            continue
        mount = f"mount --bind {shlex.quote(str(bind[0]))} {shlex.quote(str(bind[1]))}"
        command = after_private_mounts(mount, [sys.executable, script, *args], "a private bind mount")
        processes.append(subprocess.Popen(command, cwd=cwds[rank], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=environ))
    return finish(processes, timeout)


def finish(processes: list[subprocess.Popen], timeout: float) -> list[subprocess.CompletedProcess]:
    """Each of `processes` waited for (at most `timeout` seconds each) and read to its end: its exit
    code and output. Any still running after that (a timeout, a failed read) is killed, so a test
    that fails halfway leaves no process behind."""
    finished = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=timeout)
            finished.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return finished


def run_trainer_in_process(args: list[str], check: bool = False) -> subprocess.CompletedProcess:
    """`python train_full_sft.py ARGS` (`sys.exit(main())`) run in this process: its exit status, stdout and
    stderr (tests/helpers/in_process.py). For refusals and for one-process runs whose process is not what a
    test checks. As in `run_trainer`'s processes (OMP_NUM_THREADS=1) torch uses one thread.
    `check`: a failed run fails the test with its output, as `run_trainer` does."""
    import train_full_sft

    result = run_in_process(["train_full_sft.py", *args], lambda: train_full_sft.main(list(args)), threads=1)
    if check and result.returncode != 0:
        raise AssertionError(f"trainer failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def final_weights(save_dir: str) -> dict:
    """The fp32 weights of the newest resume checkpoint in `save_dir`: a .pt file, or (--fsdp 1) a
    .dcp directory of shards, read whole."""
    folder = os.path.join(save_dir, "checkpoints")
    newest = os.path.join(folder, sorted(os.listdir(folder))[-1])
    if os.path.isdir(newest):
        from trainer.checkpoint.resume import load_resume_checkpoint

        return load_resume_checkpoint(newest, required=("model_config", "model"))["model"]
    return torch.load(newest, weights_only=True)["model"]


def checkpoint_at(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, "checkpoints", f"step_{step:08d}.pt")


def assert_weights_equal(a: dict, b: dict, atol: float | None = None) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if atol is None:
            assert torch.equal(a[key], b[key]), f"{key} differs (max {(a[key] - b[key]).abs().max():.3g})"
        else:
            assert torch.allclose(a[key], b[key], atol=atol, rtol=0), f"{key} differs by {(a[key] - b[key]).abs().max():.3g}"


def eval_rows(save_dir) -> tuple[list[dict], list[dict]]:
    """The eval rows of `save_dir`'s metrics.jsonl, and all its rows."""
    rows = [json.loads(line) for line in open(os.path.join(save_dir, "metrics.jsonl"), encoding="utf-8")]
    return [row for row in rows if row["kind"] == "eval"], rows


def train_losses(save_dir: str) -> dict[int, float]:
    rows = [json.loads(line) for line in open(os.path.join(save_dir, "metrics.jsonl"), encoding="utf-8")]
    return {row["step"]: row["loss"] for row in rows if row["kind"] == "train"}


class Launcher:
    """Starts trainer processes in their own session (so a signal can reach a whole job) and
    kills whatever is still running when the test ends."""

    def __init__(self, folder):
        self.folder = folder
        self.processes = []

    def start(self, args, name, nproc=1, launcher=None, env=None, script=SCRIPT):
        """`python SCRIPT ARGS` (forked from a process that imported it, tests/helpers/warm_start.py), or under
        `launcher` (default for `nproc` > 1: torchrun), in a session of its own; its output in the folder's
        NAME.out and NAME.err. A subprocess.Popen or a warm_start.WarmProcess, which answer alike."""
        with open(self.folder / f"{name}.out", "w") as out, open(self.folder / f"{name}.err", "w") as err:
            if launcher is None and nproc == 1:
                process = warm_start.start(script, args, REPO, env or clean_env(), clean_env(), out, err)
            else:
                process = subprocess.Popen([*(launcher or torchrun_cmd(nproc)), script, *args], cwd=REPO,
                                           env=env or clean_env(), stdout=out, stderr=err, start_new_session=True)
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
