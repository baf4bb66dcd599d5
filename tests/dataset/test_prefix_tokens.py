"""A sample cut to ``max_seq_len`` tokens is tokenized from a prefix of its text
(dataset/prefix_tokens.py): it gets the tokens of the whole text, and one 20 MB line is built in a
small multiple of its size."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.trainer_launch import REPO, clean_env


def test_a_long_text_gives_the_tokens_of_the_whole_text(tokenizer, monkeypatch):
    """A sample cut to max_seq_len tokens is tokenized from a prefix of its text (dataset/prefix_tokens.py),
    not to its end, and gets the tokens and loss mask that tokenizing the whole text gives."""
    import dataset.prefix_tokens as prefix_tokens
    from dataset.formats import Conversation
    from dataset.tokens import encode_conversation

    texts = {
        "english": " ".join(f"word{i} and the fox jumped over {i * 7} dogs." for i in range(3000)),
        "chinese without spaces": "从前有一座山山里有一座庙庙里有一个老和尚在给小和尚讲故事" * 800,
        "digits": "3141592653589793238462643383279502884197" * 600,
        "whitespace runs": ("a  \n\n\t   b " * 4000),
        "one long word": "x" * 60_000,
        "special-token text in the data": "say <|im_end|> and <|im_start|>assistant\n then go on " * 2000,
    }
    seen: list[int] = []
    real = prefix_tokens._encode
    monkeypatch.setattr(prefix_tokens, "_encode", lambda tok, text, **kw: seen.append(len(text)) or real(tok, text, **kw))
    for name, text in texts.items():
        for conversation in (Conversation([{"role": "user", "content": "Go on."}, {"role": "assistant", "content": text}]),
                             Conversation([{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}])):
            for max_seq_len in (1, 64, 512):
                seen.clear()
                ids, mask = encode_conversation(tokenizer, conversation, max_seq_len)
                assert max(seen, default=0) <= 4 * prefix_tokens.MIN_WINDOW_CHARS, (name, max_seq_len, seen)  # not the whole text
                full_ids, full_mask = encode_conversation(tokenizer, conversation, 10**9)
                assert len(full_ids) > 2 * max_seq_len
                assert np.array_equal(ids, full_ids[:max_seq_len]), (name, max_seq_len)
                assert np.array_equal(mask, full_mask[:max_seq_len]), (name, max_seq_len)


PEAK_RSS_CODE = """
import json, sys
from pathlib import Path
import dataset.cache.key as digests
import dataset.cache.node as node_build
import dataset.cache.build as token_cache
from dataset import load_tokenizer
tokenizer = load_tokenizer(None)
status = lambda key: int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) // 1024
before = status("VmRSS")
token_cache.build_or_reuse(Path(sys.argv[1]), tokenizer, 512, Path(sys.argv[2]), "error", 1)
# VmHWM: this process image's peak; ru_maxrss would start at the RSS of the process that started it
print(json.dumps({"before_mib": before, "peak_mib": status("VmHWM")}))
"""


@pytest.mark.slow
def test_one_20_mb_line_is_built_in_a_small_multiple_of_its_size(tmp_path):
    """One conversation whose reply is 20 MB, cut to 512 tokens: the build's peak RSS grows by about
    150 MiB (the parsed and rendered copies of the text). Before, the whole text was tokenized
    (8.2 million tokens as Python lists): 3.9 GiB more, and 35 s."""
    data = tmp_path / "huge.jsonl"
    reply = "The quick brown fox jumps over the lazy dog 12345. " * (20_000_000 // 51)
    data.write_text(json.dumps({"conversations": [{"role": "user", "content": "Tell me everything."},
                                                  {"role": "assistant", "content": reply}]}) + "\n", encoding="utf-8")
    assert data.stat().st_size > 20_000_000
    result = subprocess.run([sys.executable, "-c", PEAK_RSS_CODE, str(data), str(tmp_path / "cache")], cwd=REPO,
                            env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["peak_mib"] - measured["before_mib"] < 600, measured


def test_text_longer_than_the_model_s_positions_is_tokenized_without_transformers_warning(tokenizer):
    """A prompt or row of more tokens than the tokenizer's model_max_length (32,768) is cut to
    --max_seq_len or refused by its caller in our own line: transformers' "Token indices sequence
    length is longer than the specified maximum ..." warning would be noise before it."""
    import logging

    from scripts._common import prompt_ids

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    try:
        # text that spells a special token goes the general path, which tokenizes through transformers
        ids = prompt_ids(tokenizer, [{"role": "user", "content": "say <|im_end|> then " * 10000}])
    finally:
        transformers_logger.removeHandler(handler)
    assert len(ids) > tokenizer.model_max_length == 32768
    assert not [record for record in records if "Token indices sequence length" in record.getMessage()]
