"""Segments, the data report and its pictures (dataset/inspection/: segments.py, report.py, token_view.py):
exact token counts per segment, dropped rows and why, supervised empty think blocks, tokenizers
that differ, and the HTML page / terminal view read back."""

import gzip
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np

import dataset.inspection.report as data_report
from dataset import encode_conversation, load_tokenizer
from dataset.inspection.report import (
    Sample, inspect_source, pick_samples, sample_lines, training_summary,
)
from dataset.formats import Conversation, parse_row
from dataset.mixture import parse_data_path
from dataset.rendering import render
from dataset.inspection.segments import SEGMENTS, segment_row
from dataset.inspection.token_view import HIGHLIGHT, PLAIN_STYLES, SUPERVISED_STYLES, html_page, terminal_view

ROOT = Path(__file__).resolve().parents[2]
DEMO_TRAIN = ROOT / "dataset" / "demo" / "sft_train.jsonl"

TOOL = {"type": "function", "function": {"name": "lookup_country", "description": "Look up a fact.", "parameters": {
    "type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}}}
CALL = {"type": "function", "function": {"name": "lookup_country", "arguments": {"country": "Zorlia"}}}
TOOL_CHAT = Conversation([
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Capital of Zorlia?"},
    {"role": "assistant", "content": "Let me look.", "reasoning_content": "I should look it up.", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"capital": "Velm"}'},
    {"role": "assistant", "content": "Velm."},
], [TOOL])
TOOLS_BLOCK = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n" + json.dumps(TOOL, ensure_ascii=False)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>")
# TOOL_CHAT as the shipped template writes it, piece by piece: (segment, text). The shipped
# tokenizer (Qwen2's pre-tokenizer) merges across some boundaries (".\n\n#", ">\n\n"): such a
# token belongs to the piece that holds its middle character.
TOOL_CHAT_PIECES = [
    ("template", "<|im_start|>system\n"), ("system", "You are terse."), ("tools block", TOOLS_BLOCK),
    ("template", "<|im_end|>\n<|im_start|>user\n"), ("user", "Capital of Zorlia?"),
    ("template", "<|im_end|>\n<|im_start|>assistant\n"),
    ("think block", "<think>\nI should look it up.\n</think>\n\n"), ("reply", "Let me look."),
    ("tool call", '\n<tool_call>\n{"name": "lookup_country", "arguments": {"country": "Zorlia"}}\n</tool_call>'),
    ("end-of-turn", "<|im_end|>"), ("template", "\n<|im_start|>user\n<tool_response>\n"),
    ("tool result", '{"capital": "Velm"}'), ("template", "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    ("think block", "<think>\n\n</think>\n\n"), ("reply", "Velm."), ("end-of-turn", "<|im_end|>"), ("template", "\n"),
]
SUPERVISED_SEGMENTS = {"think block", "reply", "tool call", "end-of-turn"}


def count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def expected_counts(tokenizer, pieces) -> dict[str, int]:
    """Tokens per segment: the whole text tokenized, each token counted for the piece holding its middle character."""
    owner = [segment for segment, text in pieces for _ in text]
    encoded = tokenizer("".join(text for _, text in pieces), add_special_tokens=False, return_offsets_mapping=True)
    counts = dict.fromkeys(SEGMENTS, 0)
    for start, end in encoded["offset_mapping"]:
        counts[owner[(start + max(end, start + 1) - 1) // 2]] += 1
    return counts


def write_rows(path: Path, rows) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n"
                            for row in rows), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- segments


def test_every_segment_has_exactly_the_tokens_of_its_text(tokenizer):
    text = render(tokenizer, TOOL_CHAT)
    assert "".join(piece for _, piece in TOOL_CHAT_PIECES) == text  # the pieces are the template's text
    expected = expected_counts(tokenizer, TOOL_CHAT_PIECES)
    row = segment_row(tokenizer, TOOL_CHAT, 4096)
    assert sum(expected.values()) == len(row.ids)
    assert dict(zip(SEGMENTS, row.counts().tolist())) == expected
    supervised = {name: expected[name] if name in SUPERVISED_SEGMENTS else 0 for name in SEGMENTS}
    assert dict(zip(SEGMENTS, row.counts(supervised_only=True).tolist())) == supervised
    assert expected["tools block"] > 80 and expected["tool call"] > 20 and expected["end-of-turn"] == 2


def test_tokens_and_mask_are_exactly_what_training_encodes(tokenizer):
    for max_seq_len in (4096, 150, 40):
        row = segment_row(tokenizer, TOOL_CHAT, max_seq_len)
        ids, mask = encode_conversation(tokenizer, TOOL_CHAT, max_seq_len)
        assert row.ids[: row.kept].tolist() == ids.tolist()
        assert row.supervised[: row.kept].tolist() == mask.tolist()


def test_pieces_join_back_to_the_text_also_for_characters_split_into_byte_tokens(tokenizer):
    conversation = Conversation([{"role": "user", "content": "龘龘 and 你好"}, {"role": "assistant", "content": "龘!"}])
    row = segment_row(tokenizer, conversation, 512)
    pieces = row.pieces()
    assert len(pieces) == len(row.ids) and "".join(row.text[a:b] for a, b in pieces) == row.text
    assert any(a == b for a, b in pieces)  # a character of several byte-level tokens: the first holds it
    assert row.counts()[SEGMENTS.index("user")] == count(tokenizer, "龘龘 and 你好")
    assert row.counts()[SEGMENTS.index("reply")] == count(tokenizer, "龘!")


def test_a_supervised_empty_think_block_is_counted_with_its_tokens(tokenizer):
    row = segment_row(tokenizer, TOOL_CHAT, 4096)
    assert row.supervised_empty_thinks() == (1, count(tokenizer, "<think>\n\n</think>\n\n"))
    assert row.thoughts == 1 and row.assistant_turns == 2
    plain = Conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello",
                                                              "reasoning_content": "A greeting."}])
    assert segment_row(tokenizer, plain, 512).supervised_empty_thinks() == (0, 0)
    start = row.empty_thinks[0][0]
    assert segment_row(tokenizer, TOOL_CHAT, start).supervised_empty_thinks() == (0, 0)  # cut off
    assert segment_row(tokenizer, TOOL_CHAT, start + 2).supervised_empty_thinks() == (1, 2)  # partly kept


def test_a_turn_is_trained_where_a_loss_token_of_it_is_kept(tokenizer):
    """TOOL_CHAT's two assistant turns (a tool call, then the answer): both trained when whole, the first
    alone when the second's loss tokens are all cut, none when the row is dropped."""
    row = segment_row(tokenizer, TOOL_CHAT, 4096)
    assert row.assistant_turns == 2 and len(row.turns) == 2 and row.trained_turns() == 2
    second = row.turns[1][0]
    assert all(row.supervised[start:end].any() for start, end in row.turns)
    assert segment_row(tokenizer, TOOL_CHAT, second).trained_turns() == 1
    assert segment_row(tokenizer, TOOL_CHAT, second + 1).trained_turns() == 2
    first = int(np.flatnonzero(row.supervised)[0])
    dropped = segment_row(tokenizer, TOOL_CHAT, first)
    assert dropped.dropped and dropped.assistant_turns == 2 and dropped.trained_turns() == 0


def test_a_tools_block_longer_than_max_seq_len_drops_the_row_with_that_reason(tokenizer):
    tools = count(tokenizer, TOOLS_BLOCK)
    dropped = segment_row(tokenizer, TOOL_CHAT, tools)
    assert dropped.dropped and dropped.truncated
    reason, detail = dropped.drop_reason()
    assert reason == "the tools block alone is longer than --max_seq_len"
    assert f"tools block {tools}" in detail
    first = int(np.flatnonzero(dropped.supervised)[0])  # tokens before the first supervised one
    longer_prompt = segment_row(tokenizer, TOOL_CHAT, first)
    assert longer_prompt.drop_reason()[0] == "the prompt before the first assistant turn is longer than --max_seq_len"
    kept = segment_row(tokenizer, TOOL_CHAT, first + 1)
    assert not kept.dropped and kept.drop_reason() is None and kept.counts(supervised_only=True).sum() == 1


def test_segments_under_another_template_without_think_blocks(tokenizer):
    other = load_tokenizer(None)
    other.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    conversation = Conversation([{"role": "user", "content": "Sum of 2 and 3?"}, {"role": "assistant", "content": "5"}])
    row = segment_row(other, conversation, 512)
    counts = dict(zip(SEGMENTS, row.counts().tolist()))
    assert counts["user"] == count(other, "Sum of 2 and 3?") and counts["reply"] == count(other, "5")
    assert counts["end-of-turn"] == 1 and counts["think block"] == 0
    assert dict(zip(SEGMENTS, row.counts(supervised_only=True).tolist()))["reply"] == counts["reply"]


# --------------------------------------------------------------------------- reports


def demo_rows(n: int) -> list[str]:
    return DEMO_TRAIN.read_text(encoding="utf-8").splitlines()[:n]


def test_with_240_tokens_every_demo_tool_conversation_is_dropped(tokenizer, tmp_path):
    lines = demo_rows(40)
    path = write_rows(tmp_path / "demo.jsonl", lines)
    report = inspect_source(parse_data_path(str(path))[0], tokenizer, 240)  # the demo's tools block: 248 tokens
    with_tools = sum(parse_row(json.loads(line)).tools is not None for line in lines)
    assert 5 <= with_tools < 40
    assert report.rows == 40 and report.total_rows == 40 and report.bad == 0
    assert report.dropped == {"the tools block alone is longer than --max_seq_len": with_tools}
    assert report.kept == 40 - with_tools
    encoded = [encode_conversation(tokenizer, parse_row(json.loads(line)), 240) for line in lines]
    kept = [(ids, mask) for ids, mask in encoded if mask.any()]
    assert report.tokens.sum() == sum(len(ids) for ids, _ in kept)
    assert report.supervised.sum() == sum(int(mask.sum()) for _, mask in kept)
    assert report.tokens[SEGMENTS.index("tools block")] == 0 and report.cut[SEGMENTS.index("tools block")] > 240 * with_tools
    warnings = report.warnings()
    assert any(f"{with_tools} of 40 rows dropped" in w and "tools block alone" in w for w in warnings)
    # the empty think blocks are counted against the turns that are trained, not those of dropped rows
    trained = sum(segment_row(tokenizer, parse_row(json.loads(line)), 240).trained_turns() for line in lines)
    assert 0 < report.trained_turns == trained < report.assistant_turns
    assert any(f"{report.empty_thinks} of {trained} trained assistant turns learn an empty think block" in w
               for w in warnings)
    cut_calls = report.cut[SEGMENTS.index("tool call")]
    assert f"{report.name}: no tool call is trained: all {cut_calls} tool call tokens are cut by --max_seq_len 240" in warnings


def test_a_source_without_supervised_tokens_bad_rows_and_truncation_are_warned(tokenizer, tmp_path):
    tool_row = {"messages": TOOL_CHAT.messages, "tools": TOOL_CHAT.tools}
    path = write_rows(tmp_path / "tools.jsonl", [tool_row, tool_row, "{not json", ""])
    report = inspect_source(parse_data_path(str(path))[0], tokenizer, 100)
    assert report.rows == 3 and report.bad == 1 and report.first_bad.startswith(f"{path}:3: invalid JSON")
    warnings = report.warnings()
    assert any("no supervised token" in w and "trains nothing" in w for w in warnings)
    assert f"{report.name}: 1 bad rows, which stop training unless --bad_data skip (first: {report.first_bad})" in warnings
    assert f"{report.name}: 1 bad rows, which --bad_data skip leaves out of training (first: {report.first_bad})" in (
        report.warnings(bad_data="skip"))
    long = inspect_source(parse_data_path(str(path))[0], tokenizer, len(segment_row(tokenizer, TOOL_CHAT, 1).ids) - 1)
    assert long.kept == 2 and long.truncated_kept == 2
    assert any("2 of the 2 rows kept are longer than --max_seq_len" in w for w in long.warnings())


def test_training_summary_is_a_few_lines_and_names_what_is_wrong(tokenizer, tmp_path):
    lines = demo_rows(60)
    tools = write_rows(tmp_path / "tools.jsonl", [line for line in lines if '"tools"' in line])
    plain = write_rows(tmp_path / "plain.jsonl", [line for line in lines if '"tools"' not in line])
    sources = parse_data_path(f"{tools}:2,{plain}")
    summary = training_summary(sources, tokenizer, 240)
    assert all(line.startswith("[data] ") for line in summary) and len(summary) <= 6
    assert summary[0].startswith("[data] inspected up to 64 rows per source") and "reply" in summary[0]
    assert any(line.startswith("[data] tools: ") and "the tools block alone is longer than --max_seq_len" in line
               for line in summary)
    assert any("warning: tools: no supervised token" in line for line in summary)
    assert sum("empty think block" in line for line in summary) == 1
    quiet = training_summary(sources, tokenizer, 240, drop_empty_think=True)
    assert not any("empty think block" in line for line in quiet)


def test_rows_are_sampled_evenly_by_line_by_seeking_and_from_compressed_files(tmp_path, monkeypatch):
    rows = [json.dumps({"i": i}) for i in range(100)]
    path = write_rows(tmp_path / "rows.jsonl", rows[:50] + [""] + rows[50:])
    lines, total = sample_lines(path, 5)
    assert total == 100 and [json.loads(line)["i"] for _, line in lines] == [0, 25, 50, 74, 99]
    assert [where for where, _ in lines] == [1, 26, 52, 76, 101]  # line numbers count the blank line
    assert len(sample_lines(path, 0)[0]) == 100
    monkeypatch.setattr(data_report, "WHOLE_FILE_BYTES", 10)
    lines, total = sample_lines(path, 4)
    assert total is None and len(lines) == 4 and all(where.startswith("byte ") for where, _ in lines)
    assert [json.loads(line)["i"] for _, line in lines] == sorted({json.loads(line)["i"] for _, line in lines})
    for where, line in lines:  # the offset names the row
        start = int(where.split()[1])
        assert path.read_bytes()[start:start + len(line)] == line
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(4):  # a source of 4 files reads each whole only up to a quarter of WHOLE_FILE_BYTES
        (shards / f"part-{k}.jsonl").write_bytes(path.read_bytes())
    monkeypatch.setattr(data_report, "WHOLE_FILE_BYTES", 2 * path.stat().st_size)
    report = inspect_source(parse_data_path(str(shards))[0], load_tokenizer(None), 64, rows=8)
    assert report.rows == report.bad == 8 and report.total_rows is None and "part-0.jsonl (byte 0): " in report.first_bad
    packed = tmp_path / "rows.jsonl.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    lines, total = sample_lines(packed, 3)
    assert total is None and [where for where, _ in lines] == [1, 2, 3]


def test_samples_shown_are_a_dropped_row_a_tool_call_and_reasoning_first(tokenizer):
    plain = Conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    thinking = Conversation([{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5",
                                                                   "reasoning_content": "Add them."}])
    rows = [segment_row(tokenizer, plain, 512)] * 5 + [segment_row(tokenizer, TOOL_CHAT, 512),
                                                        segment_row(tokenizer, thinking, 512),
                                                        segment_row(tokenizer, TOOL_CHAT, 50)]
    samples = [Sample("s", f"f:{k}", row) for k, row in enumerate(rows)]
    picked = [sample.location for sample in pick_samples(samples, 3)]
    assert picked == ["f:5", "f:6", "f:7"]  # tool call (also reasoning), reasoning, dropped
    assert len(pick_samples(samples, 20)) == 8 and pick_samples(samples, 0) == []


# --------------------------------------------------------------------------- pictures


class TokenSpans(HTMLParser):
    """The spans inside each <pre class="tokens"> of a page: (classes, title, text)."""

    def __init__(self):
        super().__init__()
        self.samples, self.span, self.in_pre, self.legend_keys, self.tables = [], None, False, [], 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if tag == "pre" and "tokens" in classes:
            self.in_pre = True
            self.samples.append([])
        elif tag == "span" and self.in_pre:
            assert self.span is None, "spans are not nested"
            self.span = [classes, attrs.get("title", ""), ""]
        elif tag == "span" and "key" in classes:
            self.legend_keys.append(classes)
        elif tag == "table":
            self.tables += 1

    def handle_endtag(self, tag):
        if tag == "span" and self.span is not None:
            self.samples[-1].append(tuple(self.span))
            self.span = None
        elif tag == "pre":
            self.in_pre = False

    def handle_data(self, data):
        if self.span is not None:
            self.span[2] += data
        else:
            assert not (self.in_pre and data), "all text inside the tokens is in token spans"


def check_page(page: str, samples: list[Sample]) -> TokenSpans:
    """Every token a span with its id and segment in its title, supervised ones highlighted, the text back."""
    parser = TokenSpans()
    parser.feed(page)
    assert len(parser.samples) == len(samples) and len(parser.legend_keys) == len(SEGMENTS)
    assert f".sup {{ background: {HIGHLIGHT}; }}" in page
    for spans, sample in zip(parser.samples, samples):
        row = sample.row
        assert len(spans) == len(row.ids)
        assert "".join(text for _, _, text in spans) == row.text
        for index, (classes, title, _) in enumerate(spans):
            assert re.search(rf"\bid {int(row.ids[index])}\b", title) and SEGMENTS[row.segments[index]] in title
            assert "t" in classes and f"seg-{SEGMENTS[row.segments[index]].replace(' ', '-')}" in classes
            supervised = index < row.kept and bool(row.supervised[index])
            assert ("sup" in classes) == supervised and ("cut" in classes) == (index >= row.kept)
    return parser


def test_the_html_page_has_a_span_per_token_with_id_segment_and_highlight(tokenizer, tmp_path):
    path = write_rows(tmp_path / "chats.jsonl", [
        {"messages": TOOL_CHAT.messages, "tools": TOOL_CHAT.tools},
        {"messages": [{"role": "user", "content": "a < b & c > d? 龘"}, {"role": "assistant", "content": "<yes> & \"no\""}]},
    ])
    report = inspect_source(parse_data_path(str(path))[0], tokenizer, 160, samples=5)
    assert len(report.samples) == 2 and report.samples[0].row.truncated
    page = html_page([report], report.samples, "data <test>", ["tokenizer: shipped"])
    parser = check_page(page, report.samples)
    assert parser.tables == 1 and "<title>data &lt;test&gt;</title>" in page
    assert sum("cut" in classes for classes, _, _ in parser.samples[0]) == len(report.samples[0].row.ids) - 160


def test_the_terminal_view_colours_supervised_tokens_and_marks_boundaries(tokenizer):
    sample = Sample("tools", "f.jsonl:1", segment_row(tokenizer, TOOL_CHAT, 4096))
    row = sample.row
    out = terminal_view(sample)
    parts = re.findall(r"(\x1b\[[0-9;]+m)([^\x1b]*)\x1b\[0m", out.split("\n", 1)[1])
    assert "".join(text for _, text in parts) == row.text.replace("\n", "↵")
    supervised = [text for style, text in parts if style in SUPERVISED_STYLES]
    lines_of = [[line for line in row.text[a:b].replace("\n", "↵\n").split("\n") if line] for a, b in row.pieces()]
    assert len(supervised) == sum(len(lines) for lines, on in zip(lines_of, row.supervised) if on)  # a part per line
    assert max(map(len, lines_of)) == 2  # e.g. ">\n\n": a token over a line break is coloured on both lines
    for line in out.split("\n")[1:]:  # neighbours on a line never look the same: boundaries show
        styles = re.findall(r"(\x1b\[[0-9;]+m)[^\x1b]*\x1b\[0m", line)
        assert all(a != b for a, b in zip(styles, styles[1:])), line
    assert set(style for style, _ in parts) == set(SUPERVISED_STYLES) | set(PLAIN_STYLES)
    plain = terminal_view(sample, colour=False)
    body = plain.split("\n", 1)[1].rsplit("\n   tokens per segment", 1)[0]
    assert "\x1b" not in plain and body.count("«") == body.count("»") == 2  # the two assistant turns
    assert re.sub("[¦«»]", "", body) == row.text.replace("\n", "↵\n")
    assert body.count("¦") == len(row.ids) - 1


def test_training_prints_the_summary_after_building_the_data(tmp_path, capsys):
    from types import SimpleNamespace

    import torch

    from tests.helpers.trainer_launch import TINY
    from trainer.args import parse_args
    from trainer.data_setup import build_train_data

    lines = demo_rows(30)
    tools = write_rows(tmp_path / "tools.jsonl", [line for line in lines if '"tools"' in line])
    plain = write_rows(tmp_path / "plain.jsonl", [line for line in lines if '"tools"' not in line])
    for extra, empty_think_warning in (((), True), (("--drop_empty_think_ratio", "0.8"), False)):
        args = parse_args([*TINY, "--data_path", f"{tools},{plain}", "--max_seq_len", "400",
                           "--cache_dir", str(tmp_path / "cache"), *extra])
        build_train_data(args, load_tokenizer(None), SimpleNamespace(world_size=1, rank=0, local_rank=0, device=torch.device("cpu")))
        out = capsys.readouterr().out.splitlines()
        summary = [line for line in out if line.startswith("[data] ") and "mixture per epoch" not in line]
        assert summary[0].startswith("[data] inspected up to 64 rows per source") and len(summary) <= 5, summary
        assert any(line.startswith("[data] tools: all ") and "cut to --max_seq_len" in line for line in summary)
        assert any(line.startswith("[data] warning: tools: ") and "rows kept are longer than --max_seq_len 400" in line
                   for line in summary)
        assert any("empty think block" in line for line in summary) == empty_think_warning
    quiet = parse_args([*TINY, "--data_path", str(plain), "--cache_dir", str(tmp_path / "cache")])
    build_train_data(quiet, load_tokenizer(None), SimpleNamespace(world_size=2, rank=1, local_rank=1, device=torch.device("cpu")))
    assert "[data] inspected" not in capsys.readouterr().out  # rank 0 only


def test_a_dropped_row_is_shown_even_after_the_rows_kept_in_memory(tokenizer, tmp_path, monkeypatch):
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    path = write_rows(tmp_path / "rows.jsonl", [plain] * 3 + [{"messages": TOOL_CHAT.messages, "tools": TOOL_CHAT.tools}])
    monkeypatch.setattr(data_report, "CANDIDATES", 2)
    report = inspect_source(parse_data_path(str(path))[0], tokenizer, 64, samples=2)
    assert [sample.location for sample in report.samples] == [f"{path}:1", f"{path}:4"] and report.samples[1].row.dropped


def test_control_characters_of_the_data_are_escaped_in_the_terminal_view(tokenizer):
    chat = Conversation([{"role": "user", "content": "a\rb"}, {"role": "assistant", "content": "c\x1b[2Jd\x07"}])
    sample = Sample("s", "f.jsonl:1", segment_row(tokenizer, chat, 4096))
    assert terminal_view(sample, colour=False) == (
        "── s · f.jsonl:1 · 25 tokens, 13 supervised; 1 supervised empty think block(s), 5 tokens\n"
        "<|im_start|>¦user¦↵\n¦a¦\\r¦b¦<|im_end|>¦↵\n¦<|im_start|>¦assistant¦↵\n¦«<think¦>↵\n↵\n¦</¦think¦>↵\n↵\n"
        "¦c¦\\x1b¦[¦2¦J¦d¦\\x07¦<|im_end|>»¦↵\n"
        "\n   tokens per segment (supervised): user 3 (0), think block 5 (5), reply 7 (7), end-of-turn 1 (1), "
        "template 9 (0)\n")
    coloured = terminal_view(sample)
    assert not re.search(r"[\r\x07]|\x1b(?!\[[0-9;]+m)", coloured)  # only the view's own colour sequences
    text = re.sub(r"\x1b\[[0-9;]+m", "", coloured)
    assert "a\\rb" in text and "c\\x1b[2Jd\\x07" in text


def test_printable_escapes_every_control_character_but_newline_and_tab():
    from dataset.printable import printable

    assert printable("a\rb\x1b[0m\x07\x00\x7f\x85\té\n") == "a\\rb\\x1b[0m\\x07\\x00\\x7f\\x85\té\n"
    # one line (a script's error): the newline escaped too, the tab kept
    assert printable("a\rb\x1b[0m\té\nc", one_line=True) == "a\\rb\\x1b[0m\té\\nc"
