"""--save_dir must be one directory that every node sees where ranks other than 0 use it (--fsdp 1, a
resume): a directory local to each node is refused at start-up, on every rank; the resume checkpoint
must be the same on every node (trainer/checkpoint/shared_dir.py)."""

import os
import shutil
import socket

import pytest
import torch

from tests.helpers.trainer_launch import SCRIPT, flags, run_ranks_apart, run_trainer_in_process
from trainer.checkpoint.shared_dir import ranks_on_hosts

HOST = socket.gethostname()


@pytest.mark.slow
@pytest.mark.parametrize("given, why", [
    (("--fsdp", "1"), "with --fsdp 1 every rank writes its shards of each checkpoint there"),
    (("--from_resume", "1"), "with --from_resume 1 every rank reads the resume checkpoint there"),
])
def test_a_save_dir_that_each_node_has_apart_is_refused_before_anything_is_written(data, tmp_path, given, why):
    # Two processes as two nodes (each local rank 0 of its own), each in a working directory of its
    # own: the relative --save_dir "run" is another folder on each "node".
    nodes = (tmp_path / "node0", tmp_path / "node1")
    for node in nodes:
        node.mkdir()
    args = flags(data, "run", "--batch_size", "2", "--max_steps", "2", "--cache_dir", str(tmp_path / "cache"), *given)
    ranks = run_ranks_apart(SCRIPT, args, local_ranks=(0, 0), cwds=nodes)
    assert [rank.returncode for rank in ranks] == [2, 2], ranks
    line = (f"error: --save_dir {nodes[0] / 'run'} is not the same directory on every node (rank 1 on host {HOST} "
            f"does not see the file that rank 0 on host {HOST} wrote there), and {why}: give a directory on a "
            "filesystem that all nodes share")  # rank 0's --save_dir, made absolute where it runs
    errors = [[text for text in rank.stderr.splitlines() if "error" in text.lower()] for rank in ranks]
    assert errors == [[line], []], ranks  # one line for the run: rank 1 has the same (print_once)
    assert os.listdir(nodes[0] / "run") == [".lock"]  # the probe removed, nothing trained or saved
    assert os.listdir(nodes[1]) == []
    assert not os.path.exists(tmp_path / "cache")  # refused before the data is tokenized


def test_a_refusal_names_the_ranks_by_host_as_ranges():
    assert ranks_on_hosts([1], ["b"]) == "rank 1 on host b"
    assert ranks_on_hosts([2, 3, 5, 9], ["b", "b", "b", "c"]) == "ranks 2-3 and 5 on host b, rank 9 on host c"
    assert ranks_on_hosts([1, 3, 5, 7], ["b", "c", "b", "c"]) == "ranks 1 and 5 on host b, ranks 3 and 7 on host c"
    assert ranks_on_hosts([1, 2, 4, 6, 8], ["b", "b", "c", "d", "e"]) == (
        "ranks 1-2 on host b, rank 4 on host c, rank 6 on host d and ranks on 1 other host")
    assert ranks_on_hosts([1, 2, 3, 4, 5], ["b", "c", "d", "e", "f"]) == (
        "rank 1 on host b, rank 2 on host c, rank 3 on host d and ranks on 2 other hosts")


@pytest.fixture(scope="module")
def two_saves(tmp_path_factory, data):
    """Two resume checkpoints of one tiny run: after steps 1 and 2."""
    run = tmp_path_factory.mktemp("saves") / "run"
    run_trainer_in_process(flags(data, run, "--batch_size", "2", "--max_steps", "2", "--save_interval", "1"),
                           check=True)
    return sorted((run / "checkpoints").glob("step_*.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("on_node1, told", [
    (None, "not every rank can read the resume checkpoint (rank 1 on host {host}: resume checkpoint {path} does not "
           "exist): every node needs the same checkpoint at {path}"),
    (0, "the resume checkpoint {path} is another one on rank 1 on host {host} (step 1 of run {run}) than on rank 0 "
        "on host {host} (step 2 of run {run}): every node needs the same checkpoint at that path"),
])
def test_a_resume_checkpoint_that_differs_between_nodes_stops_every_rank(two_saves, data, tmp_path, on_node1, told):
    # --resume_from one path, which holds the save of step 2 on node 0, and on node 1 (rank 1, which
    # sees its own folder at that path) no file, or the save of step 1.
    nodes = (tmp_path / "node0", tmp_path / "node1")
    for node in nodes:
        node.mkdir()
    shutil.copy(two_saves[1], nodes[0] / "ckpt.pt")
    if on_node1 is not None:
        shutil.copy(two_saves[on_node1], nodes[1] / "ckpt.pt")
    path = nodes[0] / "ckpt.pt"
    args = flags(data, tmp_path / "out", "--batch_size", "2", "--max_steps", "6", "--cache_dir",
                 str(tmp_path / "cache"), "--resume_from", str(path))
    ranks = run_ranks_apart(SCRIPT, args, local_ranks=(0, 0), binds=(None, (nodes[1], nodes[0])))
    assert [rank.returncode for rank in ranks] == [2, 2], ranks
    run = torch.load(two_saves[1], weights_only=True)["run_id"]
    errors = [[text for text in rank.stderr.splitlines() if "error" in text.lower()] for rank in ranks]
    assert errors == [["error: " + told.format(host=HOST, run=run, path=path)], []], ranks  # rank 1: print_once
    assert not (tmp_path / "out" / "checkpoints").exists()
    assert not (tmp_path / "cache").exists()  # refused before the data is tokenized
