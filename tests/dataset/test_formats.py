"""Data lines parsed into conversations (dataset/formats.py): the three input formats give one
sample; a bad line (NaN and Infinity, invalid UTF-8 included) is one line naming ``file:line``,
skipped and counted with ``bad_data="skip"``."""

import json

import pytest

from dataset import DataError, build_cache_and_open
from tests.helpers.chat_rows import CHAT, EMPTY_THINK, make_chat, write_lines


SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def test_three_input_formats_give_identical_samples(tokenizer, tmp_path):
    minimind = {"conversations": CHAT}
    sharegpt = {"conversations": [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in CHAT]}
    openai = {"messages": CHAT, "id": "extra keys are ignored"}
    items = []
    for name, row in [("minimind", minimind), ("sharegpt", sharegpt), ("openai", openai)]:
        ds = build_cache_and_open(write_lines(tmp_path / f"{name}.jsonl", [row]), tokenizer, 512, num_proc=1)
        items.append(ds[0])
    for item in items[1:]:
        assert item["input_ids"].tolist() == items[0]["input_ids"].tolist()
        assert item["labels"].tolist() == items[0]["labels"].tolist()


BAD_LINES = [
    ('{"conversations": [', "invalid JSON"),
    ('["not", "an", "object"]', "expected a JSON object"),
    ('{"text": "no conversation"}', "missing 'conversations' or 'messages'"),
    ('{"conversations": []}', "empty conversation"),
    ('{"conversations": "hello"}', "must be a list"),
    ('{"conversations": [{"role": "robot", "content": "beep"}]}', "unknown role 'robot'"),
    ('{"conversations": [{"role": "user"}]}', "has no 'content'"),
    ('{"conversations": [{"role": "user", "content": 5}]}', "non-string 'content'"),
    ('{"conversations": [{"content": "who?"}]}', "has no 'role'"),
    ('{"conversations": ["just text"]}', "message 1 must be a JSON object"),
    ('{"conversations": [{"from": "human", "value": 3}]}', "non-string"),
    ('{"conversations": [{"role": "user", "content": "Hi"}]}', "conversation has no assistant message"),
    ('{"conversations": [{"role": "user", "content": "Hi", "images": ["a.png"]}, {"role": "assistant", "content": "x"}]}',
     "message 1 (user) has a key 'images' that would not be rendered"),
    ('{"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x", "reasoning": "r"}]}',
     "message 2 (assistant) has a key 'reasoning' that would not be rendered"),
    ('{"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "",'
     ' "tool_calls": [{"name": "f", "arguments": "{bad"}]}]}', "tool call 1 'arguments' is a string but not valid JSON"),
    ('{"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "",'
     ' "tool_calls": [{"function": {"name": "f", "arguments": {}, "strict": true}}]}]}', "['strict'] that would not be rendered"),
    ('{"conversations": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}',
     "content part of type 'image_url'"),
    ('{"conversations": [{"role": "system", "content": "s", "tools": "not json"}, {"role": "user", "content": "q"}]}',
     "message 1 'tools' is a string but not valid JSON"),
    ('{"conversations": [{"role": "user", "content": "\\ud83d"}, {"role": "assistant", "content": "x"}]}',
     "lone surrogate"),
    ('{"conversations": ' + "[" * 200_000 + "]" * 200_000 + "}", "JSON nested too deeply"),
]


@pytest.mark.parametrize("bad_line, problem", BAD_LINES)
def test_bad_line_reports_file_and_line(tokenizer, tmp_path, bad_line, problem):
    path = write_lines(tmp_path / "bad.jsonl", [make_chat(1), make_chat(2), "", bad_line, make_chat(3)])
    with pytest.raises(DataError) as info:
        build_cache_and_open(path, tokenizer, 128, num_proc=1)
    message = str(info.value)
    assert message.startswith(f"{path}:4: ")
    assert problem in message
    assert "\n" not in message
    assert isinstance(info.value, ValueError)
    skipped = build_cache_and_open(path, tokenizer, 128, num_proc=1, bad_data="skip", cache_dir=tmp_path / "skip")
    assert len(skipped) == 3 and skipped.num_skipped == 1


USER, ANSWER = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
NESTED = {"name": "f", "arguments": {"x": 1}}
FUNCTIONS = ("top-level 'functions' (OpenAI's legacy name for tool definitions) is not read; put the definitions "
             """in 'tools', each as {"type": "function", "function": {...}}""")
# Rows that could be read two ways (a tool call in both forms: even when they agree), or whose tool
# definitions would not be read.
ONE_ROW_TWO_READINGS = [
    ({"conversations": [USER, ANSWER], "messages": [USER, {"role": "assistant", "content": "Other"}]},
     "the line has both 'conversations' and 'messages'; keep one of them (a line holds one conversation)"),
    ({"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [
        {"name": "g", "arguments": {"x": 2}, "type": "function", "function": NESTED}]}]},
     "message 2 tool call 1 has 'name' and 'arguments' beside a nested 'function'; give the call in one form, "
     "flat or nested (both are refused, even when they agree)"),
    ({"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "function": NESTED}]}]},
     "message 2 tool call 1 has 'name' beside a nested 'function'; give the call in one form, "
     "flat or nested (both are refused, even when they agree)"),
    ({"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [{**NESTED, "function": NESTED}]}]},
     "message 2 tool call 1 has 'name' and 'arguments' beside a nested 'function'; give the call in one form, "
     "flat or nested (both are refused, even when they agree)"),
    ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "function_call", "value": [
        {"arguments": {"x": 1}, "function": NESTED}]}, {"from": "gpt", "value": "ok"}]},
     "message 2 tool call 1 has 'arguments' beside a nested 'function'; give the call in one form, "
     "flat or nested (both are refused, even when they agree)"),
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}], "messages": [USER, ANSWER]}, FUNCTIONS),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "functions": [{"name": "f"}],
      "messages": [USER, ANSWER]}, FUNCTIONS),
]


def assert_the_line_between_two_chats_is_refused(tokenizer, tmp_path, row, problem: str) -> None:
    """A file of `row` (a dict, or a line as written) between two good chats is `file:2: problem`
    with no finished cache; with bad_data="skip" it gives the two chats."""
    path = write_lines(tmp_path / "data.jsonl", [make_chat(1), row, make_chat(2)])
    with pytest.raises(DataError) as info:
        build_cache_and_open(path, tokenizer, 128, num_proc=1)
    assert str(info.value) == f"{path}:2: {problem}"
    assert not list((tmp_path / ".cache").glob("*/meta.json"))  # no finished cache
    skipped = build_cache_and_open(path, tokenizer, 128, num_proc=1, bad_data="skip", cache_dir=tmp_path / "skip")
    assert len(skipped) == 2 and skipped.num_skipped == 1


@pytest.mark.parametrize("row, problem", ONE_ROW_TWO_READINGS)
def test_a_row_read_two_ways_or_with_unread_tool_definitions_is_that_lines_error(tokenizer, tmp_path, row, problem):
    assert_the_line_between_two_chats_is_refused(tokenizer, tmp_path, row, problem)


def calls(*tool_calls):
    return {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": list(tool_calls)}]}


INSIDE_FUNCTION = "that would not be rendered; inside 'function' only 'name' and 'arguments' are read"
# A call that is not a function call, or a 'function' object holding keys of the call (or of
# nothing): either would be rendered as a plain function call, the rest dropped without a word.
CALLS_NOT_RENDERED_AS_GIVEN = [
    (calls({"type": "custom", "function": NESTED}),
     "message 2 tool call 1 has type 'custom', not 'function' (only function calls are rendered)"),
    (calls({"id": "c1", "type": "function", "function": NESTED}, {"type": 5, **NESTED}),
     "message 2 tool call 2 has type 5, not 'function' (only function calls are rendered)"),
    ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "function_call", "value": [
        {"type": "code_interpreter", **NESTED}]}, {"from": "gpt", "value": "ok"}]},
     "message 2 tool call 1 has type 'code_interpreter', not 'function' (only function calls are rendered)"),
    (calls({"type": "function", "function": {**NESTED, "function": {"name": "g", "arguments": {}}}}),
     f"message 2 tool call 1 'function' has key(s) ['function'] {INSIDE_FUNCTION}"),
    (calls({"function": {"function": NESTED}}),
     f"message 2 tool call 1 'function' has key(s) ['function'] {INSIDE_FUNCTION}"),
    (calls({"function": {**NESTED, "type": "function", "id": "c1"}}),
     f"message 2 tool call 1 'function' has key(s) ['type'] {INSIDE_FUNCTION}"),
    (calls({"function": {**NESTED, "description": "adds", "type": "function"}}),
     f"message 2 tool call 1 'function' has key(s) ['description', 'type'] {INSIDE_FUNCTION}"),
]


@pytest.mark.parametrize("row, problem", CALLS_NOT_RENDERED_AS_GIVEN)
def test_a_call_of_another_type_or_with_call_keys_inside_its_function_is_that_lines_error(tokenizer, tmp_path,
                                                                                          row, problem):
    assert_the_line_between_two_chats_is_refused(tokenizer, tmp_path, row, problem)


def test_a_call_without_a_type_or_with_ids_is_the_same_function_call(tokenizer, tmp_path):
    # no type (or a null one, as a parquet struct holds for a row without it) and the ids, metadata at
    # either level, leave the tokens of the plain nested call
    items = []
    for name, call in [("plain", {"type": "function", "function": NESTED}), ("flat", NESTED),
                       ("untyped", {"function": NESTED}), ("null", {"type": None, "function": NESTED}),
                       ("ids", {"id": "c1", "type": "function", "function": {**NESTED, "id": "c1"}}),
                       # the nulls and empty values a pandas or HF export writes for struct fields a row lacks
                       ("empty type", {"type": "", "function": NESTED}),
                       ("nulls", {"name": None, "arguments": None, "id": None, "type": "function",
                                  "function": {**NESTED, "description": None, "type": None, "strict": ""}})]:
        row = {"messages": [*calls(call)["messages"], {"role": "tool", "content": "2"}, ANSWER]}
        items.append(build_cache_and_open(write_lines(tmp_path / f"{name}.jsonl", [row]), tokenizer, 512, num_proc=1)[0])
    for item in items[1:]:
        assert item["input_ids"].tolist() == items[0]["input_ids"].tolist()
        assert item["labels"].tolist() == items[0]["labels"].tolist()


def test_a_null_or_empty_conversation_key_beside_the_other_is_absent(tokenizer, tmp_path):
    # pandas' to_json of rows in both formats writes the missing one as null
    items = []
    for name, row in [("plain", {"messages": CHAT}), ("null", {"conversations": None, "messages": CHAT}),
                      ("empty", {"messages": CHAT, "conversations": []})]:
        items.append(build_cache_and_open(write_lines(tmp_path / f"{name}.jsonl", [row]), tokenizer, 512, num_proc=1)[0])
    for item in items[1:]:
        assert item["input_ids"].tolist() == items[0]["input_ids"].tolist()
        assert item["labels"].tolist() == items[0]["labels"].tolist()
    path = write_lines(tmp_path / "both_null.jsonl", [{"conversations": None, "messages": None}])
    with pytest.raises(DataError) as info:
        build_cache_and_open(path, tokenizer, 128, num_proc=1)
    assert str(info.value) == f"{path}:1: 'conversations' must be a list, got NoneType"


def test_an_empty_functions_key_carries_nothing_and_changes_no_token(tokenizer, tmp_path):
    items = []
    for name, row in [("plain", {"messages": CHAT}), ("empty", {"messages": CHAT, "functions": []}),
                      ("null", {"messages": CHAT, "functions": None})]:
        items.append(build_cache_and_open(write_lines(tmp_path / f"{name}.jsonl", [row]), tokenizer, 512, num_proc=1)[0])
    for item in items[1:]:
        assert item["input_ids"].tolist() == items[0]["input_ids"].tolist()
        assert item["labels"].tolist() == items[0]["labels"].tolist()


NOT_JSON_LINES = [
    # NaN in tool-call arguments given as an object
    ('{"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "",'
     ' "tool_calls": [{"name": "f", "arguments": {"x": NaN}}]}]}', "invalid JSON (NaN is not a JSON value)"),
    # Infinity inside tool-call arguments given as a JSON string
    ('{"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "",'
     ' "tool_calls": [{"name": "f", "arguments": "{\\"x\\": Infinity}"}]}]}',
     "tool call 1 'arguments' is a string but not valid JSON (Infinity is not a JSON value)"),
    # -Infinity inside a tools JSON string
    ('{"tools": "[{\\"type\\": \\"function\\", \\"function\\": {\\"name\\": \\"f\\", \\"max\\": -Infinity}}]",'
     ' "conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}]}',
     "'tools' is a string but not valid JSON (-Infinity is not a JSON value)"),
    # a number beyond the float range, which Python reads as infinity
    ('{"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "",'
     ' "tool_calls": [{"name": "f", "arguments": {"x": 1e999}}]}]}', "the number 1e999 is out of range"),
]


@pytest.mark.parametrize("bad_line, problem", NOT_JSON_LINES)
def test_nan_and_infinity_are_not_json_and_make_the_line_bad(tokenizer, tmp_path, bad_line, problem):
    json.loads(bad_line)  # Python's json module accepts every one of these lines
    path = write_lines(tmp_path / "nan.jsonl", [make_chat(1), bad_line, make_chat(2)])
    with pytest.raises(DataError) as info:
        build_cache_and_open(path, tokenizer, 128, num_proc=1)
    assert str(info.value).startswith(f"{path}:2: ") and problem in str(info.value), str(info.value)
    assert "\n" not in str(info.value)
    skipped = build_cache_and_open(path, tokenizer, 128, num_proc=1, bad_data="skip", cache_dir=tmp_path / "skip")
    assert len(skipped) == 2 and skipped.num_skipped == 1



HI, ASK = '{"role": "user", "content": "Hi"}', '{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": '
# A key twice in one JSON object, at any depth: Python's json keeps the last value and drops the
# other without a word; which one the data meant is not guessed.
DUPLICATE_KEYS = [
    ('{"conversations": [' + HI + ', {"role": "assistant", "content": "A"}], "conversations": [' + HI
     + ', {"role": "assistant", "content": "B"}]}', "invalid JSON (duplicate key 'conversations' in one JSON object)"),
    ('{"messages": [{"role": "user", "content": "Hi", "content": "Bye"}, {"role": "assistant", "content": "x"}]}',
     "invalid JSON (duplicate key 'content' in one JSON object)"),
    ('{"messages": [' + HI + ', ' + ASK + '{"city": {"name": "Velm", "name": "Oslo"}}}]}]}',
     "invalid JSON (duplicate key 'name' in one JSON object)"),
    ('{"messages": [' + HI + ', ' + ASK + '"{\\"city\\": \\"Velm\\", \\"unit\\": \\"C\\", \\"city\\": \\"Oslo\\"}"}]}]}',
     "message 2 tool call 1 'arguments' is a string but not valid JSON (duplicate key 'city' in one JSON object)"),
    ('{"tools": "[{\\"type\\": \\"function\\", \\"type\\": \\"function\\", \\"function\\": {\\"name\\": \\"f\\"}}]",'
     ' "messages": [' + HI + ', {"role": "assistant", "content": "x"}]}',
     "'tools' is a string but not valid JSON (duplicate key 'type' in one JSON object)"),
    # the same key however it is escaped; a key with a control character is written escaped
    ('{"messages": [{"role": "user", "content": "Hi", "\\u0063ontent": "Bye"}, {"role": "assistant", "content": "x"}]}',
     "invalid JSON (duplicate key 'content' in one JSON object)"),
    ('{"messages": [' + HI + ', {"role": "assistant", "content": "x"}], "id\\r": 1, "id\\r": 2}',
     "invalid JSON (duplicate key 'id\\r' in one JSON object)"),
]


@pytest.mark.parametrize("bad_line, problem", DUPLICATE_KEYS)
def test_a_key_twice_in_one_json_object_is_that_lines_error(tokenizer, tmp_path, bad_line, problem):
    json.loads(bad_line)  # Python's json module accepts every one of these lines, keeping the last value
    assert_the_line_between_two_chats_is_refused(tokenizer, tmp_path, bad_line, problem)


def test_a_key_in_two_objects_is_no_duplicate():
    from dataset.formats import loads, parse_line

    row = parse_line('{"messages": [{"role": "user", "content": "Hi", "id": 1}, {"role": "assistant", "content": '
                     '"", "tool_calls": [{"name": "f", "arguments": "{\\"x\\": {\\"x\\": 1}, \\"y\\": {\\"x\\": 2}}"}]}],'
                     ' "id": 2}')
    assert row.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": {"x": 1}, "y": {"x": 2}}
    assert loads(b'{"a": {"a": 1}}') == {"a": {"a": 1}}  # json.loads' own path (bytes) too
    with pytest.raises(ValueError, match="duplicate key 'a' in one JSON object"):
        loads(b'{"a": 1, "a": 1}')

def test_skip_mode_keeps_good_samples_and_reports(tokenizer, tmp_path, capsys):
    rows = [make_chat(1), BAD_LINES[0][0], make_chat(2), BAD_LINES[5][0], make_chat(3)]
    path = write_lines(tmp_path / "mixed.jsonl", rows)
    ds = build_cache_and_open(path, tokenizer, 128, bad_data="skip", num_proc=1)
    assert len(ds) == 3 and ds.num_skipped == 2 and ds.num_dropped == 0
    answers = [tokenizer.decode([t for t in ds[i]["labels"] if t != -100]) for i in range(3)]
    assert answers == [f"{EMPTY_THINK}{n}<|im_end|>" for n in (2, 3, 4)]
    printed = capsys.readouterr().out
    assert "skipped 2 bad lines" in printed and f"{path}:2:" in printed
    # The same cache loaded in "error" mode still raises for the first bad line.
    with pytest.raises(DataError, match=f"{path}:2: invalid JSON"):
        build_cache_and_open(path, tokenizer, 128, num_proc=1)


def test_invalid_utf8_line_is_reported(tokenizer, tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [make_chat(1), make_chat(2)])
    with path.open("ab") as f:
        f.write(b'{"conversations": [{"role": "user", "content": "\xff"}]}\n')
    with pytest.raises(DataError, match=f"{path}:3: invalid UTF-8"):
        build_cache_and_open(path, tokenizer, 128, num_proc=1)
