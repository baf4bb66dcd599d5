"""A process that waits for another one to build a token cache says so, and for what: at once when
another live process holds the build's lock, and under torch.distributed once local rank 0 has taken
longer than reusing a cache takes (dataset/cache/resumable.py, dataset/cache/node.py)."""

import threading
import time
from pathlib import Path

import torch.distributed

import dataset.cache.node as node_build
from dataset.cache import waiting
from dataset.cache import build_or_reuse
from dataset.cache.key import ROWS_VERSION, TOKENS_VERSION, cache_key, data_digest
from dataset.cache.resumable import partial_dir
from tests.helpers.cache_checks import hold_lock
from tests.helpers.chat_rows import chat_line, write_rows


def test_a_builder_waiting_for_a_live_builder_says_so_at_once(tokenizer, tmp_path, capsys):
    path = write_rows(tmp_path / "w.jsonl", [chat_line(i) for i in range(4)])
    cache_root = tmp_path / "cache"
    target = cache_root / cache_key(data_digest(path, cache_root), tokenizer, 64, TOKENS_VERSION, ROWS_VERSION)
    holder = hold_lock(partial_dir(target) / "lock", 1.5)  # another builder of the same cache, for 1.5 s
    try:
        assert build_or_reuse(path, tokenizer, 64, cache_root, num_proc=1) == target
    finally:
        holder.kill()
        holder.wait()
    waits = [line for line in capsys.readouterr().err.splitlines() if line.startswith("waiting for")]
    # One line at once (the next would come after WAIT_REPORT_S = 30 s), naming the builder and the cache.
    assert waits == [f"waiting for process otherhost.4242, which is building this token cache, {target} (0 s)"]


def wait_for_local_outcome(after: float, capsys) -> list[str]:
    """The lines rank 1 prints to stderr while local rank 0 sets its outcome in the store ``after`` seconds
    after the wait begins."""
    store, key = torch.distributed.HashStore(), "minisft/cache-build-nonce/rank0"

    def set_later():
        time.sleep(after)
        store.set(key, '[null, "/cache/key", null]')

    setter = threading.Thread(target=set_later)
    setter.start()
    assert node_build.wait_for_local_build(store, key, 1, Path("d.jsonl")) == (None, "/cache/key", None)
    setter.join()
    printed = capsys.readouterr()
    assert "waiting" not in printed.out  # stderr, with the other cache progress lines
    return printed.err.splitlines()


def test_a_rank_waiting_for_local_rank_0_says_so_once_it_builds(capsys):
    assert waiting.WAIT_FIRST_S == 2.0 and waiting.WAIT_REPORT_S == 30.0
    assert wait_for_local_outcome(0.5, capsys) == []  # a reused cache is ready before WAIT_FIRST_S
    [line] = wait_for_local_outcome(3.0, capsys)  # a build: one line at 2 s, the next only at 32 s
    assert line == "rank 1: waiting for local rank 0 to build the token cache of d.jsonl (2 s)"
