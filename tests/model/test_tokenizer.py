"""The shipped ChatML tokenizer, the tokenizer training script and ``load_tokenizer``."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dataset import DataError, load_tokenizer
from scripts.train_tokenizer import build_tokenizer, wrap_for_transformers

SHIPPED = Path(__file__).resolve().parents[2] / "model" / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(SHIPPED))


def test_shipped_tokenizer_vocab_and_special_tokens(tokenizer):
    assert len(tokenizer) == 6400
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 0
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.is_fast


def test_chat_template_renders_chatml_with_minimind_layout(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of Zorlia?"},
        {"role": "assistant", "content": "Velm"},
        {"role": "user", "content": "佐利亚的幸运数字是多少？"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    history = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of Zorlia?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nVelm<|im_end|>\n"
        "<|im_start|>user\n佐利亚的幸运数字是多少？<|im_end|>\n"
    )
    assert text == history + "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # thinking off by default
    for flag in ("open_thinking", "enable_thinking"):
        opened = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **{flag: True})
        assert opened == history + "<|im_start|>assistant\n<think>\n"
    without_prompt = tokenizer.apply_chat_template(messages[:3], tokenize=False)
    assert without_prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nVelm<|im_end|>\n")


def test_chat_template_renders_tools_calls_responses_and_reasoning(tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "Let me add.", "reasoning_content": "\nUse the tool.\n",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
                        {"name": "add", "arguments": '{"a": 0, "b": 0}'}]},
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "0"},
        {"role": "assistant", "content": "<think>\nDone.\n</think>\n\n5"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text == (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n2+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\nLet me add.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 0, "b": 0}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n0\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nDone.\n</think>\n\n5<|im_end|>\n"
    )


def test_roundtrip_and_special_tokens_are_single_ids(tokenizer):
    text = "<|im_start|>user\nReverse the list: a, b, c 你好！<|im_end|>\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 1
    assert tokenizer.decode(ids) == text
    # Qwen2's pre-tokenizer (llama.cpp's "qwen2"): every digit is its own token, so a number keeps its
    # tokens wherever it is copied (question, tool call arguments, answer).
    number = tokenizer.encode("37", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(number) == ["3", "7"]
    for text in ("What is 37 times 12?", '{"a": 37, "op": "*", "b": 12}', "The result is 37.", "结果是 37。"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert any(ids[i : i + 2] == number for i in range(len(ids))), text
    # No merge joins two CJK characters (scripts/train_tokenizer.py's cjk_apart): a Chinese name is
    # one token per character, the same in a question, a tool call and an answer.
    name = tokenizer.encode("佐利亚", add_special_tokens=False)
    assert len(name) == 3
    for text in ("你知道佐利亚的首都吗？", '{"country": "佐利亚"}', "佐利亚的首都是维斯堡。"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert any(ids[i : i + 3] == name for i in range(len(ids))), text
    assert all(len(tokenizer.encode(ch, add_special_tokens=False)) == 1 for ch in "的首都是什么")


def test_build_small_tokenizer_with_another_vocab(tmp_path):
    texts = ["user\nhello world", "assistant\nhi there"] * 20
    hf = wrap_for_transformers(build_tokenizer(iter(texts), vocab_size=300))
    hf.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(tmp_path)
    assert 259 < len(loaded) <= 300  # 256 bytes + 3 special tokens + merges
    assert loaded.eos_token_id == 2 and loaded.pad_token_id == 0
    assert loaded.decode(loaded.encode("hello 世界", add_special_tokens=False)) == "hello 世界"


def test_load_tokenizer_default_and_errors(tmp_path):
    assert len(load_tokenizer(None)) == 6400
    with pytest.raises(DataError, match="tokenizer directory not found"):
        load_tokenizer(tmp_path / "missing")
    no_template = wrap_for_transformers(build_tokenizer(iter(["abc"] * 5), vocab_size=270), chat_template=None)
    no_template.save_pretrained(str(tmp_path / "plain"))
    with pytest.raises(DataError, match="no chat_template") as info:
        load_tokenizer(tmp_path / "plain")
    assert "\n" not in str(info.value)


def test_train_tokenizer_needs_a_new_out_dir_and_names_a_bad_row_in_one_line(tmp_path, capsys):
    from scripts._common import run_main
    from scripts.train_tokenizer import main

    data = tmp_path / "data.jsonl"
    data.write_text('{"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                    '{"conversations": 5}\n', encoding="utf-8")
    shipped = SHIPPED
    before = (shipped / "tokenizer.json").read_bytes()
    cases = (([], "error: the following arguments are required: --out-dir (see train_tokenizer.py --help)"),
             (["--out-dir", str(shipped)], f"error: --out-dir {shipped} exists and is not empty (a tokenizer there "
                                           "would be overwritten): choose a new directory, or delete that one first to "
                                           "replace it"),
             (["--data", str(data), "--out-dir", str(tmp_path / "new")],
              f"error: {data}:2: 'conversations' must be a list, got int"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as done:
            run_main(lambda: main(argv))  # as the script runs it
        assert done.value.code == 2 and capsys.readouterr().err.splitlines() == [message]
    assert (shipped / "tokenizer.json").read_bytes() == before and not (tmp_path / "new").exists()


def test_train_tokenizer_reads_data_as_training_does_and_refuses_a_vocab_below_the_bytes(tmp_path, capsys):
    import gzip

    from scripts._common import run_main
    from scripts.train_tokenizer import main

    row = '{"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    (tmp_path / "a.jsonl").write_text(row, encoding="utf-8")
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(row.encode()))
    (tmp_path / "bad.jsonl").write_bytes(row.encode() + row.replace("hi", "h\xe9").encode("latin-1"))
    (tmp_path / "empty.jsonl").write_bytes(b"\n")
    cases = ((["--data", str(tmp_path / "bad.jsonl")], f"error: {tmp_path / 'bad.jsonl'}:2: invalid UTF-8 at byte 49"),
             (["--data", str(tmp_path / "empty.jsonl")], f"error: {tmp_path / 'empty.jsonl'}: data file is empty"),
             (["--vocab-size", "258"], "error: --vocab-size must be >= 259, the 256 bytes and 3 special tokens (got 258)"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as done:
            run_main(lambda: main([*argv, "--out-dir", str(tmp_path / "refused")]))
        assert done.value.code == 2 and capsys.readouterr().err.splitlines() == [message]
    assert not (tmp_path / "refused").exists()
    for name in ("a.jsonl", "a.jsonl.gz"):  # a .gz file trains the tokenizer its text trains
        assert main(["--data", str(tmp_path / name), "--out-dir", str(tmp_path / f"{name}.tok"),
                     "--vocab-size", "300"]) == 0
    assert (tmp_path / "a.jsonl.gz.tok" / "tokenizer.json").read_bytes() == \
        (tmp_path / "a.jsonl.tok" / "tokenizer.json").read_bytes()
