"""The local rank a launch gives as ``--local_rank`` (the legacy ``torch.distributed.launch``,
RANK and WORLD_SIZE in the environment but no LOCAL_RANK) is the one every step uses: the token
cache is built by local rank 0 of the node alone (dataset/cache/node.py), as under torchrun."""

import os
import subprocess
import sys

import pytest

from tests.helpers.trainer_launch import REPO, clean_env, finish, flags, free_port


@pytest.mark.slow
def test_the_token_cache_is_built_once_per_node_when_local_rank_comes_as_a_flag(data, tmp_path):
    port = str(free_port())
    script = os.path.join(REPO, "tests", "helpers", "counted_cache_build.py")
    args = flags(data, tmp_path / "run", "--batch_size", "2", "--max_steps", "1", "--save_interval", "0",
                 "--cache_dir", str(tmp_path / "cache"))
    processes = [subprocess.Popen(
        [sys.executable, script, *args, "--local_rank", str(rank)], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env=clean_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for rank in (0, 1)]
    ranks = finish(processes, timeout=240)
    assert [rank.returncode for rank in ranks] == [0, 0], [rank.stderr for rank in ranks]
    builds = [line for rank in ranks for line in rank.stderr.splitlines() if "built the token cache" in line]
    assert builds == ["rank 0 built the token cache of train.jsonl"], [rank.stderr for rank in ranks]
