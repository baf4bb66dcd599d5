"""The ChatML encoder behind the seam (dataset/chatml_encoder.py, dataset/chatml.py) gives what the general path
(rendering.encode_with_template) gives: the same token ids, the same loss mask, the same error, for
every row, every template and tokenizer shape the tests know.

The fast path renders ChatML conversations in Python, tokenizes a chunk in one backend call and
tokenizes a repeated system turn once; each is used only where it is exact (module docstrings).
"""

import copy
import glob
import json
import random
from pathlib import Path

import numpy as np
import pytest

from dataset import chatml, rendering
from dataset.chatml_encoder import ChatMLEncoder as ChunkEncoder
from dataset.formats import Conversation, LineError, parse_line
from dataset.rendering import encode_with_template as encode_conversation
from dataset.rendering import load_tokenizer
from tests.helpers.templates import ALT_TEMPLATE, THINK_TEMPLATE, make_alt_tokenizer, with_template

ROOT = Path(__file__).resolve().parents[2]
DEMO_FILES = sorted(glob.glob(str(ROOT / "dataset" / "demo" / "*.jsonl")))


@pytest.fixture(scope="module")
def demo_conversations():
    return [parse_line(line) for path in DEMO_FILES for line in open(path, encoding="utf-8") if line.strip()]


# The general path's results, per tokenizer object, per conversation object (both kept alive here, so
# that an id is not reused). Every tokenizer and conversation of these tests is built before its first
# encoding and not changed after it: a result depends on nothing else.
SPANS: dict[tuple[int, int], tuple] = {}  # loss_spans: the rendering, the same for every max_seq_len
GENERAL: dict[tuple[int, int, int], tuple] = {}  # encode_with_template, per max_seq_len


@pytest.fixture(scope="module", autouse=True)
def forget_the_general_path():
    """The remembered results (tens of MB for the demo set) go with this module's tests."""
    yield
    SPANS.clear()
    GENERAL.clear()


def remembered(table, key, objects, compute):
    """`compute()`'s value, or the LineError it raised (raised again), computed once per key."""
    if key not in table:
        try:
            table[key] = (objects, compute(), None)
        except LineError as exc:
            table[key] = (objects, None, exc)
    _, value, error = table[key]
    if error is not None:
        raise error.with_traceback(None)
    return value


def general(tokenizer, conversation, max_seq_len):
    """encode_with_template's ids and mask, or its LineError. Its loss_spans (the chat template's
    renderings, most of its time) is computed once per tokenizer and conversation, whatever the
    max_seq_len: the same function on the same arguments."""
    real_loss_spans = rendering.loss_spans

    def loss_spans(tok, conv):
        if tok is not tokenizer or conv is not conversation:
            return real_loss_spans(tok, conv)
        key = (id(tokenizer), id(conversation))
        return remembered(SPANS, key, (tokenizer, conversation), lambda: real_loss_spans(tokenizer, conversation))

    def encode():
        rendering.loss_spans = loss_spans
        try:
            return encode_conversation(tokenizer, conversation, max_seq_len)
        finally:
            rendering.loss_spans = real_loss_spans

    try:
        return remembered(GENERAL, (id(tokenizer), id(conversation), max_seq_len), (tokenizer, conversation), encode)
    except LineError as exc:
        return exc


def assert_same_as_general(tokenizer, conversations, max_seq_len, chunk=512):
    """Every conversation through ChunkEncoder (in chunks, as the build does) == the general path."""
    encoder = ChunkEncoder(tokenizer, max_seq_len)
    for first in range(0, len(conversations), chunk):
        part = conversations[first:first + chunk]
        for number, (conversation, fast) in enumerate(zip(part, encoder.encode(part)), start=first):
            expected = general(tokenizer, conversation, max_seq_len)
            if isinstance(expected, LineError):
                assert isinstance(fast, LineError) and str(fast) == str(expected), (number, fast, expected)
                continue
            assert not isinstance(fast, LineError), (number, fast)
            ids, mask = fast
            assert ids.dtype == expected[0].dtype and mask.dtype == expected[1].dtype
            assert np.array_equal(ids, expected[0]), (number, conversation)
            assert np.array_equal(mask, expected[1]), (number, conversation)
    return encoder


# ----------------------------------------------------------------------------- random conversations

PIECES = ["Hello", " world", "\n", "\n\n", "  ", "维尔姆", "佐利亚的首都", "42", "3.5", '"quoted"', "back\\slash", "<think>",
          "</think>", "<tool_call>", "</tool_response>", "{\"a\": 1}", "😀", "\t", "é", "<|im_", "|>", "assistant\n"]
RARE = ["<|im_end|>", "<|im_start|>assistant\n", "<|endoftext|>", "\ud800"]  # special-token text; a lone surrogate


def random_text(rng: random.Random, rare: float = 0.02) -> str:
    parts = [rng.choice(RARE) if rng.random() < rare else rng.choice(PIECES) for _ in range(rng.randint(0, 8))]
    return "".join(parts)


def random_call(rng):
    arguments = {"q": random_text(rng), "n": rng.randint(-5, 500), "x": rng.choice([0.25, True, None, [1, "b"]])}
    if rng.random() < 0.3:
        arguments = json.dumps(arguments, ensure_ascii=rng.random() < 0.5)
    return {"type": "function", "function": {"name": rng.choice(["lookup", "calc", "f_" + random_text(rng, 0)]),
                                              "arguments": arguments}}


def random_conversation(rng: random.Random) -> Conversation:
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": random_text(rng)})
    for _ in range(rng.randint(1, 5)):
        role = rng.choice(["user", "user", "assistant", "assistant", "tool", "system"])
        if role == "assistant":
            message = {"role": "assistant", "content": random_text(rng)}
            choice = rng.random()
            if choice < 0.3:
                message["reasoning_content"] = random_text(rng)
            elif choice < 0.4:
                message["reasoning_content"] = ""
            elif choice < 0.5:
                message["content"] = f"<think>{random_text(rng)}</think>{random_text(rng)}"
            if rng.random() < 0.3:
                message["tool_calls"] = [random_call(rng) for _ in range(rng.randint(1, 3))]
        else:
            message = {"role": role, "content": random_text(rng)}
        messages.append(message)
    if rng.random() < 0.9:
        messages.append({"role": "assistant", "content": random_text(rng)})
    tools = None
    if rng.random() < 0.4:
        tools = [{"type": "function", "function": {"name": "lookup", "description": random_text(rng),
                                                    "parameters": {"type": "object", "n": rng.randint(0, 9)}}}]
    return Conversation(messages, tools)


RANDOM = [random_conversation(random.Random(seed)) for seed in range(1500)]


# ----------------------------------------------------------------------------- the shipped tokenizer


def test_the_whole_demo_set_gives_the_tokens_and_masks_of_the_general_path(tokenizer, demo_conversations):
    assert len(demo_conversations) == 11_500
    encoder = assert_same_as_general(tokenizer, demo_conversations, 1024)
    assert encoder.fast and encoder.split_pattern is not None
    assert 0 < encoder.piece_chars <= 2 * (1 << 21)  # pieces remembered


def test_cut_demo_rows_give_the_tokens_and_masks_of_the_general_path(tokenizer, demo_conversations):
    rows = demo_conversations[:400] + demo_conversations[-400:]
    for max_seq_len in (1, 48, 300):
        assert_same_as_general(tokenizer, rows, max_seq_len, chunk=97)


def test_random_conversations_give_the_tokens_masks_and_errors_of_the_general_path(tokenizer):
    errors = [general(tokenizer, conversation, 64) for conversation in RANDOM]
    assert 20 < sum(isinstance(error, LineError) for error in errors) < 500  # assistant first, lone surrogates
    for max_seq_len in (64, 4096):
        assert_same_as_general(tokenizer, RANDOM, max_seq_len, chunk=128)


def test_long_texts_go_through_the_prefix_tokenizer_with_the_same_result(tokenizer):
    rng = random.Random(7)
    long = [Conversation([{"role": "system", "content": "S " * 3000}, {"role": "user", "content": random_text(rng) * 900},
                          {"role": "assistant", "content": "维尔姆 " * 4000, "reasoning_content": "r " * 50}])
            for _ in range(3)]
    for max_seq_len in (16, 700):
        assert_same_as_general(tokenizer, long + RANDOM[:50], max_seq_len)


# ----------------------------------------------------------------------------- which templates


# A template in MiniMind's layout written another way (whitespace control per line, a namespace, the
# roles in another order): the fast path is chosen by what a template renders, not by its text.
MINIMIND_LAYOUT = """
{%- set ns = namespace(system=messages[0].role == 'system') %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if ns.system %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" + (tool | tojson) }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif ns.system %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- if message.tool_calls %}
            {%- for call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
                {%- if call.function %}{%- set call = call.function %}{%- endif %}
                {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
                {%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'user' or not loop.first %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}
"""


def test_a_template_in_minimind_s_layout_written_otherwise_takes_the_fast_path(tokenizer, demo_conversations):
    other = with_template(tokenizer, MINIMIND_LAYOUT)
    assert other.chat_template != tokenizer.chat_template
    encoder = assert_same_as_general(other, demo_conversations[::7] + RANDOM[:300], 512)
    assert encoder.fast


def test_other_templates_keep_the_general_path(tokenizer, demo_conversations, tmp_path):
    rows = demo_conversations[::53] + RANDOM[:200]
    think = assert_same_as_general(with_template(tokenizer, THINK_TEMPLATE), rows, 512)  # Qwen3-like, not prefix-stable
    assert not think.fast
    alt_tokenizer = load_tokenizer(make_alt_tokenizer(tmp_path / "alt", ALT_TEMPLATE))
    plain = [conversation for conversation in rows if not conversation.tools and all(
        m["role"] in ("system", "user", "assistant") and "tool_calls" not in m for m in conversation.messages)]
    alt = assert_same_as_general(alt_tokenizer, plain, 512)
    assert not alt.fast


# Each of these one-place changes of the shipped template renders some conversation differently:
# the probe conversations must catch every one, or a template that differs would take the fast path.
MUTATIONS = [
    ("messages[0].content + '\\n\\n'", "messages[0].content + '\\n'"),
    ("'\\n' + (tool | tojson)", "'\\n' + (tool | tojson(ensure_ascii=true))"),
    ("'\\n' + (tool | tojson)", "'\\n' + (tool | tojson(sort_keys=true))"),
    ("'<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n'", "'<|im_start|>system\\n' + messages[0].content + '<|im_end|>'"),
    ("message.role == 'user' or (message.role == 'system' and not loop.first)", "message.role == 'user'"),
    ("thought.strip('\\n')", "thought"),
    ("text.lstrip('\\n') -}}", "text -}}"),
    ("not loop.first or text", "not loop.first"),
    ("fn.arguments if fn.arguments is string else (fn.arguments | tojson)", "fn.arguments | tojson"),
    ("loop.first or messages[loop.index0 - 1].role != 'tool'", "true"),
    ("loop.last or messages[loop.index0 + 1].role != 'tool'", "loop.last"),
    ("elif '</think>' in text", "elif false"),
    ("text.split('</think>')[-1].lstrip('\\n')", "text.split('</think>')[-1]"),
    ("'}\\n</tool_call>'", "'}</tool_call>'"),
    ("'\\n<tool_response>\\n' + text", "'\\n<tool_response>' + text"),
    ("'<|im_start|>assistant\\n<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n'", "'<|im_start|>assistant\\n'"),
    ("{{- '<|im_end|>\\n' -}}\n    {%- elif message.role == 'tool'", "{{- '<|im_end|>' -}}\n    {%- elif message.role == 'tool'"),
]


@pytest.mark.parametrize("old,new", MUTATIONS)
def test_the_probes_tell_a_changed_template_from_the_layout(tokenizer, old, new):
    assert chatml.matches_template(tokenizer)
    assert tokenizer.chat_template.count(old) == 1, old
    assert not chatml.matches_template(with_template(tokenizer, tokenizer.chat_template.replace(old, new)))


# ----------------------------------------------------------------------------- tokenizer shapes


@pytest.mark.parametrize("normalized", [False, True])
def test_minimind_s_tokenizer_shape_non_special_added_tokens(tokenizer, demo_conversations, normalized):
    """MiniMind's tokenizer adds <think>, <tool_call>, ... as non-special tokens (normalized=False):
    they split the text too. Normalized added tokens are matched in a second pass, inside the pieces."""
    from tokenizers import AddedToken

    other = copy.deepcopy(tokenizer)
    other.add_tokens([AddedToken(text, normalized=normalized) for text in
                      ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]])
    encoder = assert_same_as_general(other, demo_conversations[::11] + RANDOM[:400], 1024)
    assert encoder.fast and ("tool_call" in encoder.split_pattern.pattern) != normalized


def test_a_normalizer_or_a_stripping_added_token_keeps_the_whole_text_in_one_piece(tokenizer, demo_conversations):
    from tokenizers import AddedToken, normalizers

    with_normalizer = copy.deepcopy(tokenizer)
    with_normalizer.backend_tokenizer.normalizer = normalizers.NFKC()
    stripping = copy.deepcopy(tokenizer)
    stripping.add_tokens([AddedToken("<tool_call>", rstrip=True, lstrip=True)])
    for other in (with_normalizer, stripping):
        encoder = assert_same_as_general(other, demo_conversations[::29] + RANDOM[:200], 1024)
        assert encoder.fast and encoder.split_pattern is None
