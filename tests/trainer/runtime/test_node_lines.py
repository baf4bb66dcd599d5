"""An error that every process of a node meets alike before the process group starts is printed
once per node, by local rank 0; one that only some processes meet is printed by each of them."""

import re
import time

import pytest

from tests.helpers.trainer_launch import REPO, TINY, run_trainer, torchrun_cmd
from trainer.errors import DistributedError, NodeLaunchError
from trainer.runtime.distributed import gpu_for_local_rank
from trainer.runtime.node_lines import SLURM_NAMES, TORCHRUN_NAMES, prints_for_node


def test_local_rank_zero_prints_for_its_node():
    assert prints_for_node({})  # no launcher: the only process
    torchrun = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert [prints_for_node({**torchrun, "LOCAL_RANK": str(rank), "RANK": str(8 + rank)}) for rank in range(3)] == [
        True, False, False]
    assert prints_for_node({"LOCAL_RANK": "1"})  # left in the shell, no launch (as launcher.launch_env reads it)
    slurm = {"SLURM_NTASKS": "16", "SLURM_PROCID": "9"}
    assert [prints_for_node({**slurm, "SLURM_LOCALID": str(rank)}) for rank in range(3)] == [True, False, False]
    assert prints_for_node({"SLURM_NTASKS": "1", "SLURM_LOCALID": "3"})  # one task: not a launch of several
    # torchrun inside an srun task: torchrun's local rank counts
    assert not prints_for_node({**slurm, **torchrun, "SLURM_LOCALID": "0", "LOCAL_RANK": "1", "RANK": "1"})


def test_only_a_refusal_that_every_process_of_the_node_meets_is_a_node_line():
    for rank in range(2):  # the launcher says 2 processes: both refuse with the same line
        with pytest.raises(NodeLaunchError):
            gpu_for_local_rank(rank, 2, 1, False)
    # No launcher says how many: local rank 0 does not refuse, local rank 2 does, and prints it itself
    assert gpu_for_local_rank(0, None, 2, False) == 0
    with pytest.raises(DistributedError) as refused:
        gpu_for_local_rank(2, None, 2, False)
    assert not isinstance(refused.value, NodeLaunchError)


@pytest.mark.slow
@pytest.mark.parametrize("flag, line", [
    (["--epochs", "0"], "--epochs must be >= 1 (got 0)"),
    # each worker refuses before the rendezvous, which would wait --dist_timeout for a third process
    (["--world_size", "3"], "--world_size 3 but the launcher started 2 processes (WORLD_SIZE=2): leave --world_size "
                            "out under a launcher, it sets the number"),
])
def test_a_flag_error_under_torchrun_is_printed_once_and_the_run_exits_2(tmp_path, flag, line):
    start = time.monotonic()
    result = run_trainer([*TINY, *flag, "--save_dir", str(tmp_path / "run"), "--dist_timeout", "600"], nproc=2,
                         check=False, timeout=120, launcher=torchrun_cmd(2))
    assert time.monotonic() - start < 60  # two starts of the trainer, no wait for a peer
    output = result.stdout + result.stderr
    assert [text for text in output.splitlines() if text.startswith("error:")] == [f"error: {line}"], output[-3000:]
    # no traceback of ours (torchrun's own names its files, which sit in a .venv inside the repo in CI)
    assert not re.search(rf'File "{re.escape(REPO)}/(?!\.venv/)', output), output[-3000:]
    # torchrun's report per worker: 2 each, also for the worker that torchrun stops once the other has exited
    assert re.findall(r"exitcode\s*: (\S+) \(pid", output) == ["2", "2"], output[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("env, line", [
    ({"RANK": "5", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
     "RANK=5 is not below WORLD_SIZE=2: the ranks of 2 processes are 0 to 1 (the launcher sets them)"),
    ({"RANK": "0", "WORLD_SIZE": "x"},
     "WORLD_SIZE='x' in the environment is not a whole number >= 1 (the launcher sets it: torchrun, srun or your "
     "own script)"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "-1"},
     "SLURM_LOCALID='-1' in the environment is not a whole number >= 0 (the launcher sets it: torchrun, srun or "
     "your own script)"),
    # RANK - LOCAL_RANK is the node's first rank: a wrong one has ranks wait for a token cache no process builds
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
     "LOCAL_RANK=1 is above RANK=0: a process's rank on its node cannot exceed its rank in the run (the launcher "
     "sets them)"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
     "RANK=1 with LOCAL_RANK=0 and LOCAL_WORLD_SIZE=2 puts this node's ranks past WORLD_SIZE=2 (the launcher sets "
     "them)"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"},
     "LOCAL_RANK=1 is not below LOCAL_WORLD_SIZE=1: the local ranks of 1 processes are 0 to 0 (the launcher sets "
     "them)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"},
     "LOCAL_WORLD_SIZE=3 is above WORLD_SIZE=2: a node cannot hold more processes than the run (the launcher sets "
     "them)"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"},
     "SLURM_LOCALID=1 is above SLURM_PROCID=0: a process's rank on its node cannot exceed its rank in the run (the "
     "launcher sets them)"),
])
def test_launcher_variables_that_cannot_describe_a_launch_are_one_line_before_any_rendezvous(
        data, tmp_path, monkeypatch, env, line):
    # RANK=5 of 2 would wait --dist_timeout for peers that cannot come; int() of a word would be a traceback
    from tests.helpers.trainer_launch import flags, run_trainer_in_process

    set_launch_env(monkeypatch, env)
    done = run_trainer_in_process(flags(data, tmp_path / "run", "--dist_timeout", "600"))
    assert (done.returncode, done.stderr.splitlines()) == (2, [f"error: {line}"])


def set_launch_env(monkeypatch, env: dict) -> None:
    """Exactly the launcher variables `env`, none of the others."""
    for name in (*TORCHRUN_NAMES, *SLURM_NAMES, "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("env, extra, line", [
    ({"RANK": "1"}, [],
     "RANK=1 is in the environment but WORLD_SIZE is not: a launcher sets both (torchrun); unset it to run one "
     "process, or start N with --world_size N"),
    ({"WORLD_SIZE": "2"}, ["--world_size", "2"],
     "WORLD_SIZE=2 is in the environment but RANK is not: a launcher sets both (torchrun); unset it to run one "
     "process, or start N with --world_size N"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, ["--world_size", "4"],
     "--world_size 4 but the launcher started 2 processes (WORLD_SIZE=2): leave --world_size out under a launcher, "
     "it sets the number"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, ["--world_size", "3"],
     "--world_size 3 but the launcher started 2 processes (SLURM_NTASKS=2): leave --world_size out under a "
     "launcher, it sets the number"),
])
def test_a_launch_whose_number_of_processes_is_unclear_is_one_line(data, tmp_path, monkeypatch, env, extra, line):
    # neither trains as one process nor as the launcher's number while --world_size says another
    from tests.helpers.trainer_launch import flags, run_trainer_in_process

    set_launch_env(monkeypatch, env)
    done = run_trainer_in_process(flags(data, tmp_path / "run", *extra))
    assert (done.returncode, done.stderr.splitlines()) == (2, [f"error: {line}"])
    assert not (tmp_path / "run").exists()


def test_a_flag_error_under_a_local_rank_that_is_not_a_number_is_the_flags_line(data, tmp_path, monkeypatch):
    # the flag error is printed by local rank 0 of each node; a LOCAL_RANK that int() cannot read is not
    # a reason for a traceback in place of the flag's line (the launch check names it when the flags pass)
    from tests.helpers.trainer_launch import flags, run_trainer_in_process

    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}.items():
        monkeypatch.setenv(name, value)
    done = run_trainer_in_process(flags(data, tmp_path / "run", "--epochs", "0"))
    assert (done.returncode, done.stderr.splitlines()) == (2, ["error: --epochs must be >= 1 (got 0)"])
    done = run_trainer_in_process(flags(data, tmp_path / "run"))
    assert (done.returncode, done.stderr.splitlines()) == (2, [
        "error: LOCAL_RANK='x' in the environment is not a whole number >= 0 (the launcher sets it: torchrun, srun "
        "or your own script)"])
