"""Tool calls and reasoning in a sample (dataset/formats.py, dataset/rendering.py): their loss spans,
token for token, with the shipped template and with ones that are not prefix-stable (each turn's span
its own where a later turn or the data renders alike); the three formats
of a tool conversation give one sample; only a leading think block is reasoning, ambiguous think
tags are that line's error."""

import glob
import json
from pathlib import Path

import pytest

from dataset import DataError, build_cache_and_open
from dataset.formats import LineError, parse_line, parse_row
from dataset.rendering import loss_spans
from tests.helpers.chat_rows import (
    CALL, CALL_TEXT, EMPTY_THINK, RESULT, TOOL_CHAT_MINIMIND, TOOLS, make_chat, write_lines,
)
from tests.helpers.templates import QWEN3_TEMPLATE, THINK_TEMPLATE, with_template


TOOL_CHAT_OPENAI = {"tools": TOOLS, "messages": [
    {"role": "system", "content": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]},
    {"role": "user", "content": "Capital of Zorlia?"},
    {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "refusal": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "lookup_country", "arguments": json.dumps(CALL["arguments"])}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "lookup_country", "content": RESULT},
    {"role": "assistant", "content": "Velm"},
]}
TOOL_CHAT_SHAREGPT = {"system": "You are terse.", "tools": json.dumps(TOOLS), "conversations": [
    {"from": "human", "value": "Capital of Zorlia?"},
    {"from": "gpt", "value": "<think>\nLook it up.\n</think>\n\n"},
    {"from": "function_call", "value": json.dumps(CALL)},
    {"from": "observation", "value": RESULT},
    {"from": "gpt", "value": "Velm"},
]}


def loss_runs(item) -> list[list[int]]:
    """The token ids of each contiguous run of loss positions."""
    runs, current = [], []
    for token, label in zip(item["input_ids"].tolist(), item["labels"].tolist()):
        if label != -100:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def assert_token_exact(tokenizer, item, full_text: str, spans: list[str]) -> None:
    """The ids are the tokenization of ``full_text``; the loss runs are exactly ``spans``, token for token."""
    assert item["input_ids"].tolist() == tokenizer(full_text, add_special_tokens=False)["input_ids"]
    runs = loss_runs(item)
    assert [tokenizer.decode(run) for run in runs] == spans
    assert runs == [tokenizer(span, add_special_tokens=False)["input_ids"] for span in spans]


def test_tool_and_reasoning_spans_with_the_shipped_template(tokenizer, tmp_path):
    ds = build_cache_and_open(write_lines(tmp_path / "tool.jsonl", [TOOL_CHAT_MINIMIND]), tokenizer, 1024, num_proc=1)
    tools_block = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
        "function signatures within <tools></tools> XML tags:\n<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call>"
    )
    first = f"<think>\nLook it up.\n</think>\n\n{CALL_TEXT}<|im_end|>"
    second = f"{EMPTY_THINK}Velm<|im_end|>"
    full = (
        f"<|im_start|>system\nYou are terse.\n\n{tools_block}<|im_end|>\n<|im_start|>user\nCapital of Zorlia?<|im_end|>\n"
        f"<|im_start|>assistant\n{first}\n<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\n{second}\n"
    )
    assert_token_exact(tokenizer, ds[0], full, [first, second])


def test_tool_and_reasoning_spans_with_a_template_that_is_not_prefix_stable(tokenizer, tmp_path):
    import copy

    other = with_template(tokenizer, THINK_TEMPLATE)
    row = copy.deepcopy(TOOL_CHAT_MINIMIND)
    row["conversations"] += [{"role": "user", "content": "And Quendor?"},
                             {"role": "assistant", "content": "Ostra", "reasoning_content": "I know it."}]
    ds = build_cache_and_open(write_lines(tmp_path / "tool.jsonl", [TOOL_CHAT_MINIMIND, row]), other, 1024, num_proc=1)
    call = '<tool_call>{"name": "lookup_country", "arguments": {"country": "Zorlia", "field": "capital"}}</tool_call>'
    head = (f"<|im_start|>system\nYou are terse.\n\n<tools>\n{json.dumps(TOOLS[0])}\n</tools><|im_end|>\n"
            "<|im_start|>user\nCapital of Zorlia?<|im_end|>\n<|im_start|>assistant\n")
    # One question: both turns follow the last user message and keep their think blocks.
    spans = [f"<think>\nLook it up.\n</think>\n\n{call}<|im_end|>", f"{EMPTY_THINK}Velm<|im_end|>"]
    full = f"{head}{spans[0]}\n<|im_start|>tool\n{RESULT}<|im_end|>\n<|im_start|>assistant\n{spans[1]}\n"
    assert_token_exact(tokenizer, ds[0], full, spans)
    # A later question: the template drops the earlier think blocks; what it renders is learned.
    spans = [f"{call}<|im_end|>", "Velm<|im_end|>", "<think>\nI know it.\n</think>\n\nOstra<|im_end|>"]
    full = (f"{head}{spans[0]}\n<|im_start|>tool\n{RESULT}<|im_end|>\n<|im_start|>assistant\n{spans[1]}\n"
            f"<|im_start|>user\nAnd Quendor?<|im_end|>\n<|im_start|>assistant\n{spans[2]}\n")
    assert_token_exact(tokenizer, ds[1], full, spans)


QUESTION = "<|im_start|>user\nCapital of Zorlia?<|im_end|>\n<|im_start|>assistant\n"
ANSWER = f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
REPEATED_TURNS = [  # rows whose last reply repeats an earlier one, and the text before each assistant turn
    ({"conversations": [{"role": "user", "content": "Capital of Zorlia?"}, {"role": "assistant", "content": "Velm"}] * 2},
     [QUESTION, QUESTION]),
    ({"conversations": [{"role": "user", "content": "Capital of Zorlia?"},
                        {"role": "assistant", "content": "", "tool_calls": [CALL]},
                        {"role": "tool", "content": RESULT}, {"role": "assistant", "content": "Velm"}] * 2},
     [QUESTION, ANSWER] * 2),
]
REPEATED_SPANS = {  # per template, the loss spans of each row
    "shipped": [[f"{EMPTY_THINK}Velm<|im_end|>"] * 2,
                [f"{EMPTY_THINK}{CALL_TEXT}<|im_end|>", f"{EMPTY_THINK}Velm<|im_end|>"] * 2],
    # An assistant turn before the last question has no think block; the last message has an empty one.
    "qwen3": [["Velm<|im_end|>", f"{EMPTY_THINK}Velm<|im_end|>"],
              [f"{CALL_TEXT}<|im_end|>", "Velm<|im_end|>", f"{CALL_TEXT}<|im_end|>", f"{EMPTY_THINK}Velm<|im_end|>"]],
}


@pytest.mark.parametrize("template", ["shipped", "qwen3"])
def test_a_turn_s_span_is_at_its_own_header_when_a_later_turn_renders_alike(tokenizer, tmp_path, template):
    """Qwen3's last message, an empty think block and the reply, is the text an earlier turn with that
    reply renders as when it is the last message: each span is its own turn's, token for token."""
    other = with_template(tokenizer, QWEN3_TEMPLATE) if template == "qwen3" else tokenizer
    rows = [row for row, _ in REPEATED_TURNS]
    ds = build_cache_and_open(write_lines(tmp_path / "repeated.jsonl", rows), other, 1024, num_proc=1)
    for index, ((row, heads), spans) in enumerate(zip(REPEATED_TURNS, REPEATED_SPANS[template])):
        assert_token_exact(tokenizer, ds[index], "".join(f"{head}{span}\n" for head, span in zip(heads, spans)), spans)
        text, found = loss_spans(other, parse_row(row))  # the general path (the build's, for Qwen3's template)
        assert [text[start:end] for start, end in found] == spans


def test_a_header_that_data_spells_before_a_turn_is_passed_over(tokenizer):
    """Qwen3 drops the call turn's think block, so the reply's span is searched from the call's end: the
    tool result's text ``<|im_start|>assistant\n`` is not the reply's header."""
    row = {"conversations": [
        {"role": "user", "content": "Capital of Zorlia?"},
        {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [CALL]},
        {"role": "tool", "content": "Answer as <|im_start|>assistant\nVelm"}, {"role": "assistant", "content": "Velm"},
        {"role": "user", "content": "And Quendor?"}, {"role": "assistant", "content": "Ostra"}]}
    text, spans = loss_spans(with_template(tokenizer, QWEN3_TEMPLATE), parse_row(row))
    assert [text[start:end] for start, end in spans] == [
        f"{CALL_TEXT}<|im_end|>", "Velm<|im_end|>", f"{EMPTY_THINK}Ostra<|im_end|>"]
    assert text.count("<|im_start|>assistant\nVelm") == 2


def repeats_last_reply(messages: list[dict]) -> bool:
    """Does the row end with an assistant turn without reasoning that an earlier turn is equal to."""
    last = messages[-1]
    return last["role"] == "assistant" and not last.get("reasoning_content") and last in messages[:-1]


def test_qwen3_s_template_refuses_no_demo_row_whose_last_reply_repeats_an_earlier_turn(tokenizer):
    """The demo rows where an earlier turn, as the last message, renders as Qwen3's last message does."""
    qwen3 = with_template(tokenizer, QWEN3_TEMPLATE)
    demo = sorted(glob.glob(str(Path(__file__).resolve().parents[2] / "dataset" / "demo" / "*.jsonl")))
    rows = [parse_line(line) for path in demo for line in open(path, encoding="utf-8")]
    repeated = [row for row in rows if repeats_last_reply(row.messages)]
    refused = []
    for row in repeated:
        try:
            loss_spans(qwen3, row)
        except LineError as error:
            refused.append(str(error))
    assert (len(rows), len(repeated), refused) == (11_500, 181, [])


def test_three_formats_of_a_tool_conversation_give_identical_samples(tokenizer, tmp_path):
    items = []
    for name, row in [("minimind", TOOL_CHAT_MINIMIND), ("openai", TOOL_CHAT_OPENAI), ("sharegpt", TOOL_CHAT_SHAREGPT)]:
        items.append(build_cache_and_open(write_lines(tmp_path / f"{name}.jsonl", [row]), tokenizer, 1024, num_proc=1)[0])
    for item in items[1:]:
        assert item["input_ids"].tolist() == items[0]["input_ids"].tolist()
        assert item["labels"].tolist() == items[0]["labels"].tolist()
    assert len(loss_runs(items[0])) == 2


def think_row(content: str, **extra) -> dict:
    return {"conversations": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": content, **extra}]}


def test_only_a_leading_think_block_is_split_from_assistant_content(tokenizer, tmp_path):
    rows = [
        think_row(" \n<think>\nAdd them.\n</think>\n\n5"),  # a leading block (after whitespace): the reasoning
        think_row("5", reasoning_content="Add them."),
        think_row("Sure. <think>x</think> done"),  # text before <think>: all of it is text
        think_row("Write <think> to open it and </think> to close it."),  # prose naming the tags
        think_row("<think>r</think>\n\nThe tags are <think> and </think>."),  # tags after a leading block
        think_row("<think>\n\n</think>\n\nThe tags are <think> and </think>.", reasoning_content=""),
    ]
    ds = build_cache_and_open(write_lines(tmp_path / "think.jsonl", rows), tokenizer, 256, num_proc=1)
    head = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    spans = [
        "<think>\nAdd them.\n</think>\n\n5<|im_end|>",
        "<think>\nAdd them.\n</think>\n\n5<|im_end|>",
        f"{EMPTY_THINK}Sure. <think>x</think> done<|im_end|>",
        f"{EMPTY_THINK}Write <think> to open it and </think> to close it.<|im_end|>",
        "<think>\nr\n</think>\n\nThe tags are <think> and </think>.<|im_end|>",
        f"{EMPTY_THINK}The tags are <think> and </think>.<|im_end|>",
    ]
    for index, span in enumerate(spans):
        assert_token_exact(tokenizer, ds[index], f"{head}{span}\n", [span])


AMBIGUOUS_THINK = [
    (think_row("I should add.</think>\n\n5"), "has a </think> without a <think> before it"),
    (think_row("The </think> tag ends a thought."), "has a </think> without a <think> before it"),
    (think_row("<think>r</think>5 and a stray </think>"), "has a </think> without a <think> before it"),
    (think_row("<think>\nI should add, but the line was cut"), "starts with <think> but has no </think>"),
    (think_row("<think>\nAdd.\n</think>\n\n5", reasoning_content="Add."),
     "has both 'reasoning_content' and a <think> block at the start of its content"),
]


@pytest.mark.parametrize("row, problem", AMBIGUOUS_THINK)
def test_ambiguous_think_tags_are_that_lines_error(tokenizer, tmp_path, row, problem):
    path = write_lines(tmp_path / "think.jsonl", [make_chat(1), row, make_chat(2)])
    with pytest.raises(DataError) as info:
        build_cache_and_open(path, tokenizer, 128, num_proc=1)
    assert str(info.value).startswith(f"{path}:2: message 2 ") and problem in str(info.value), str(info.value)
    skipped = build_cache_and_open(path, tokenizer, 128, num_proc=1, bad_data="skip", cache_dir=tmp_path / "skip")
    assert len(skipped) == 2 and skipped.num_skipped == 1
