"""Which GPU each process of a launch takes, and the launches that cannot work (refused in one
line before the process group starts)."""

import os
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.trainer_launch import REPO, clean_env, flags, run_trainer, torchrun_cmd
from trainer.errors import DistributedError, NodeLaunchError
from trainer.runtime.distributed import gpu_for_local_rank, gpus_given_per_task, pick_device, processes_on_this_node


@pytest.mark.parametrize("visible", [1, 2, 8])
def test_each_local_rank_takes_its_own_visible_gpu(visible):
    # torchrun --nproc_per_node N with N <= visible GPUs (CUDA_VISIBLE_DEVICES=2,3: visible 2, ranks -> 0, 1)
    for processes in range(1, visible + 1):
        assert [gpu_for_local_rank(rank, processes, visible, False) for rank in range(processes)] == list(range(processes))


@pytest.mark.parametrize("visible", [1, 2, 8])
def test_more_local_processes_than_visible_gpus_is_refused_in_one_line(visible):
    processes = visible + 1
    for rank in range(processes):  # every rank refuses, so none waits for the others in the rendezvous
        with pytest.raises(DistributedError) as refused:
            gpu_for_local_rank(rank, processes, visible, False, "2,3")
        assert str(refused.value) == (
            f"{processes} processes on this node but this process sees {visible} GPU(s) (CUDA_VISIBLE_DEVICES=2,3): "
            f"start at most {visible} per node (torchrun --nproc_per_node {visible}, srun --ntasks-per-node {visible}), "
            "or give each process its own GPU (srun --gpus-per-task 1)")
    # No launcher says how many processes share the node: local rank 2 needs 3 GPUs at least.
    with pytest.raises(DistributedError, match="^3 processes on this node but this process sees 2 GPU"):
        gpu_for_local_rank(2, None, 2, False)
    assert gpu_for_local_rank(0, None, 1, False) == 0


def test_slurm_gpus_per_task_give_every_local_rank_device_0():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_GPUS_PER_TASK": "1"}
    assert processes_on_this_node(env) == 8 and gpus_given_per_task(env, 1)
    assert [gpu_for_local_rank(rank, 8, 1, True) for rank in range(8)] == [0] * 8
    # A binding that shows each task one of the step's 8 GPUs, without --gpus-per-task
    bound = {**env, "SLURM_STEP_GPUS": "0,1,2,3,4,5,6,7"}
    del bound["SLURM_GPUS_PER_TASK"]
    assert gpus_given_per_task(bound, 1) and not gpus_given_per_task(bound, 8)
    # Two tasks sharing one GPU (--gres=gpu:1, no per-task binding): refused
    shared = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2"}
    assert processes_on_this_node(shared) == 2 and not gpus_given_per_task(shared, 1)
    with pytest.raises(DistributedError, match="^2 processes on this node but this process sees 1 GPU"):
        gpu_for_local_rank(1, processes_on_this_node(shared), 1, gpus_given_per_task(shared, 1))


@pytest.mark.parametrize("given", ["1", "a100:1"])
def test_gpus_per_task_that_srun_did_not_bind_leave_each_local_rank_its_own_gpu(given):
    # srun --ntasks-per-node 8 --gpus-per-task 1 --gpu-bind=none (or a SLURM that does not bind
    # --gpus-per-task): every task sees the node's 8 GPUs, so each takes cuda:LOCAL_RANK; cuda:0 for
    # all would put the node's 8 ranks on one GPU, which NCCL refuses at init
    env = {"SLURM_PROCID": "11", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3", "SLURM_NODEID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_GPUS_PER_TASK": given}
    assert not gpus_given_per_task(env, 8)
    assert [gpu_for_local_rank(rank, 8, 8, gpus_given_per_task(env, 8)) for rank in range(8)] == list(range(8))
    assert gpus_given_per_task(env, 1)  # bound: the task sees its own GPU only
    assert gpus_given_per_task({**env, "SLURM_GPUS_PER_TASK": "2"}, 2)
    assert not gpus_given_per_task({**env, "SLURM_GPUS_PER_TASK": "2"}, 8)


def test_an_explicit_gpu_for_every_process_of_a_node_is_refused_under_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    torchrun = {"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "2,3"}
    for backend in ("auto", "nccl"):
        for rank in (0, 1):  # every process of the node refuses alike, before the rendezvous
            with pytest.raises(NodeLaunchError) as refused:
                pick_device(SimpleNamespace(device="cuda:1", backend=backend), rank, torchrun)
            assert str(refused.value) == ("--device cuda:1 puts the 2 processes of this node on one GPU, which NCCL "
                                          "refuses: leave --device out (local rank r takes cuda:r), or use --backend gloo")
    assert pick_device(SimpleNamespace(device="cuda:1", backend="gloo"), 1, torchrun) == torch.device("cuda", 1)
    alone = {"LOCAL_WORLD_SIZE": "1"}
    assert pick_device(SimpleNamespace(device="cuda:1", backend="auto"), 0, alone) == torch.device("cuda", 1)
    assert pick_device(SimpleNamespace(device="auto", backend="auto"), 1, torchrun) == torch.device("cuda", 1)
    # srun --gpus-per-task 1 without a binding: both tasks see both GPUs, cuda:0 is one GPU for the two
    per_task = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_GPUS_PER_TASK": "1"}
    with pytest.raises(NodeLaunchError, match="^--device cuda:0 puts the 2 processes of this node on one GPU"):
        pick_device(SimpleNamespace(device="cuda:0", backend="auto"), 1, per_task)
    # srun --gpus-per-task 1, bound: each task sees its own GPU as cuda:0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device(SimpleNamespace(device="cuda:0", backend="auto"), 1, per_task) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DistributedError, match="^--device cuda:0 puts the 2 processes of this node on one GPU") as one:
        pick_device(SimpleNamespace(device="cuda:0", backend="nccl"), 1, {})  # no launcher says: local rank 1
    assert type(one.value) is DistributedError  # not known to be alike on the node: every rank prints it


def test_processes_on_this_node_from_the_launchers():
    assert processes_on_this_node({"LOCAL_WORLD_SIZE": "4", "SLURM_GPUS_PER_TASK": "1"}) == 4
    # torchrun inside an srun task: its processes share what the task sees
    assert not gpus_given_per_task({"LOCAL_WORLD_SIZE": "8", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                                    "SLURM_GPUS_PER_TASK": "8"}, 8)
    assert processes_on_this_node({"SLURM_PROCID": "0", "SLURM_NTASKS": "10", "SLURM_NODEID": "2",
                                   "SLURM_STEP_TASKS_PER_NODE": "4(x2),2"}) == 2
    assert processes_on_this_node({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "8"}) is None
    assert processes_on_this_node({}) is None


@pytest.mark.slow
def test_torchrun_with_two_processes_on_one_visible_gpu_exits_2_in_one_line(data, tmp_path):
    result = run_trainer(flags(data, tmp_path, "--max_steps", "1"), nproc=2, check=False, timeout=120,
                         launcher=torchrun_cmd(2), script=os.path.join(REPO, "tests", "helpers", "fake_gpus.py"),
                         env=clean_env(MINISFT_TEST_FAKE_GPUS="1", CUDA_VISIBLE_DEVICES="0"))
    line = ("error: 2 processes on this node but this process sees 1 GPU(s) (CUDA_VISIBLE_DEVICES=0): start at most "
            "1 per node (torchrun --nproc_per_node 1, srun --ntasks-per-node 1), or give each process its own GPU "
            "(srun --gpus-per-task 1)")
    assert result.returncode != 0
    assert result.stderr.count(line) == 1, result.stderr[-3000:]  # both ranks refuse before any rendezvous; rank 0 says it
    assert "exitcode  : 2" in result.stderr  # torchrun's report of its failed workers
    assert "trainer/runtime" not in result.stderr  # no traceback of ours
    assert not os.path.exists(tmp_path / "checkpoints")
