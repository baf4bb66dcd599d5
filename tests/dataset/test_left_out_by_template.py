"""A chat template that leaves out what a conversation carries (dataset/rendering.py): tools, tool
calls or reasoning missing from the rendered text make that line bad, naming what the template left
out, instead of a sample trained without them (a call turn learned as an empty reply). Qwen3's
template leaves out the reasoning of turns that a user message follows, by design, and keeps its
rows; so does the shipped template."""

import copy
import glob
from pathlib import Path

import pytest

from dataset import DataError, build_cache_and_open, load_tokenizer
from dataset.formats import LineError, parse_line, parse_row
from dataset.rendering import encode_with_template, loss_spans
from tests.helpers.chat_rows import CALL, CALL_TEXT, RESULT, TOOL_CHAT_MINIMIND, TOOLS, make_chat, write_lines
from tests.helpers.templates import PLAIN_CHATML, QWEN3_TEMPLATE, THINK_TEMPLATE, with_template

ROOT = Path(__file__).resolve().parents[2]

CALL_ROW = {"conversations": [
    {"role": "user", "content": "Capital of Zorlia?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": RESULT},
    {"role": "assistant", "content": "Velm"},
]}
REASONING_ROW = {"conversations": [{"role": "user", "content": "2 plus 3?"},
                                   {"role": "assistant", "content": "5", "reasoning_content": "Add them."}]}
TOOLS_ROW = {"tools": TOOLS, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
# The tool's name in the question and the reply: they are data, not the template's rendering of it.
NAMED_ROW = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "Use lookup_country."},
    {"role": "assistant", "content": "I call lookup_country.", "tool_calls": [{"name": "lookup_country", "arguments": {}}]},
    {"role": "tool", "content": "lookup_country: no answer"},
    {"role": "assistant", "content": "No answer."},
]}
LATER_QUESTION = [{"role": "user", "content": "And Quendor?"},
                  {"role": "assistant", "content": "Ostra", "reasoning_content": "I know it."}]

LEFT_OUT = [
    (CALL_ROW, "tool calls (assistant message 2: 'lookup_country')"),
    (REASONING_ROW, "reasoning (assistant message 2)"),
    (TOOLS_ROW, "tools ('lookup_country')"),
    (NAMED_ROW, "tools ('lookup_country') and tool calls (assistant message 2: 'lookup_country')"),
    (TOOL_CHAT_MINIMIND, "tools ('lookup_country'), tool calls (assistant message 3: 'lookup_country') and "
                         "reasoning (assistant message 3)"),
]


@pytest.fixture(scope="module")
def plain_chatml(tokenizer, tmp_path_factory) -> str:
    """A tokenizer directory: the shipped tokenizer with a ChatML template of roles and contents only."""
    directory = tmp_path_factory.mktemp("plain_chatml")
    with_template(tokenizer, PLAIN_CHATML).save_pretrained(str(directory))
    return str(directory)


@pytest.mark.parametrize("row, left_out", LEFT_OUT, ids=["tool call", "reasoning", "tools", "names in the text", "all three"])
def test_what_the_template_leaves_out_is_that_lines_error(plain_chatml, tmp_path, row, left_out):
    path = write_lines(tmp_path / "a.jsonl", [make_chat(1), row, make_chat(2)])
    with pytest.raises(DataError) as info:
        build_cache_and_open(path, plain_chatml, 256, num_proc=1)
    assert str(info.value) == (f"{path}:2: the chat template of {plain_chatml} does not render this "
                               f"conversation's {left_out}")
    skipped = build_cache_and_open(path, plain_chatml, 256, num_proc=1, bad_data="skip", cache_dir=tmp_path / "skip")
    assert (len(skipped), skipped.num_skipped) == (2, 1)
    assert load_tokenizer(plain_chatml).decode(skipped[1]["input_ids"]) == (
        "<|im_start|>user\nWhat is 2 plus 1?<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n")


def span_texts(tokenizer, row) -> list[str]:
    text, spans = loss_spans(tokenizer, parse_row(row))
    return [text[start:end] for start, end in spans]


def test_qwen3_s_template_leaves_out_only_the_reasoning_of_turns_a_user_message_follows(tokenizer):
    qwen3 = with_template(tokenizer, QWEN3_TEMPLATE)
    row = copy.deepcopy(TOOL_CHAT_MINIMIND)
    row["conversations"] += LATER_QUESTION
    assert span_texts(qwen3, row) == [f"{CALL_TEXT}<|im_end|>", "Velm<|im_end|>",
                                      "<think>\nI know it.\n</think>\n\nOstra<|im_end|>"]
    assert span_texts(qwen3, TOOL_CHAT_MINIMIND) == [f"<think>\nLook it up.\n</think>\n\n{CALL_TEXT}<|im_end|>",
                                                     "<think>\n\n</think>\n\nVelm<|im_end|>"]


def test_the_reasoning_of_a_turn_no_user_message_follows_must_be_in_the_text(tokenizer):
    """A template that keeps only the last message's think block: the call turn's reasoning, which
    no user message follows, is left out of the text that trains it."""
    last_only = with_template(tokenizer, THINK_TEMPLATE.replace("loop.index0 > ns.last_user", "loop.last"))
    with pytest.raises(LineError) as info:
        loss_spans(last_only, parse_row(TOOL_CHAT_MINIMIND))
    assert str(info.value) == (f"the chat template of {tokenizer.name_or_path} does not render this "
                               "conversation's reasoning (assistant message 3)")
    row = copy.deepcopy(TOOL_CHAT_MINIMIND)
    row["conversations"] += LATER_QUESTION  # a user message follows it: rendered as the last message is enough
    call = '<tool_call>{"name": "lookup_country", "arguments": {"country": "Zorlia", "field": "capital"}}</tool_call>'
    assert span_texts(last_only, row) == [f"{call}<|im_end|>", "Velm<|im_end|>",
                                          "<think>\nI know it.\n</think>\n\nOstra<|im_end|>"]


def test_names_and_arguments_written_as_ascii_json_are_rendered(tokenizer):
    ascii_json = with_template(tokenizer, tokenizer.chat_template.replace("tojson", "tojson(ensure_ascii=true)"))
    tool = {"type": "function", "function": {"name": "查找", "parameters": {"type": "object"}}}
    row = {"tools": [tool], "messages": [
        {"role": "user", "content": "维尔姆?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "查找", "arguments": {"城市": "维尔姆 \"北\""}}]}]}
    assert span_texts(ascii_json, row) == [
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "查找", "arguments": '
        '{"\\u57ce\\u5e02": "\\u7ef4\\u5c14\\u59c6 \\"\\u5317\\""}}\n</tool_call><|im_end|>']


@pytest.mark.parametrize("template", [None, QWEN3_TEMPLATE], ids=["shipped", "qwen3"])
def test_templates_that_render_tools_calls_and_reasoning_refuse_no_demo_row_for_them(tokenizer, template):
    other = with_template(tokenizer, template) if template else tokenizer
    demo = sorted(glob.glob(str(ROOT / "dataset" / "demo" / "*.jsonl")))
    rows = [parse_line(line) for path in demo for line in open(path, encoding="utf-8")][::23]
    refused = []
    for conversation in rows:
        try:
            encode_with_template(other, conversation, 1024)
        except LineError as error:
            refused.append(str(error))
    assert (len(rows), refused) == (500, [])
