"""A node that builds its token cache for longer than --dist_timeout does not fail the others: they
wait for it through the store, polling, with a progress line (dataset/cache/node.py)."""

import os

import pytest

from tests.helpers.trainer_launch import REPO, flags, run_ranks_apart


@pytest.mark.slow
def test_a_cache_build_longer_than_dist_timeout_on_one_node_fails_nobody(data, tmp_path):
    # Two processes as two nodes (each local rank 0 of its own), gloo, --dist_timeout 4; rank 0's build
    # takes 10 s longer, so rank 1 waits more than twice the collective timeout.
    timeout = 4
    args = [*flags(data, tmp_path / "run", "--batch_size", "2", "--max_steps", "2", "--save_interval", "0",
                   "--cache_dir", str(tmp_path / "cache")), "--dist_timeout", str(timeout)]
    ranks = run_ranks_apart(os.path.join(REPO, "tests", "helpers", "slow_cache_build.py"), args, local_ranks=(0, 0),
                            MINISFT_TEST_SLOW_BUILD_RANK="0", MINISFT_TEST_SLOW_BUILD_S="10")
    assert [rank.returncode for rank in ranks] == [0, 0], ranks
    stdout, stderr = ranks[1].stdout, ranks[1].stderr
    waits = [line for line in stderr.splitlines() if line.startswith("rank 1: waiting for the other nodes")]
    assert len(waits) >= 2 * timeout - 2, ranks[1]  # one a second, for longer than the collective timeout
    assert "waiting" not in stdout  # on stderr, with the other cache progress lines
    assert os.path.isdir(tmp_path / "run" / "model")
