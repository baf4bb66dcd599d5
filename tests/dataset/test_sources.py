"""Reading data files (dataset/sources.py): a ``.jsonl.gz`` or ``.parquet`` file gives the cache of
the jsonl of the same rows (parquet structs, nulls and columns not read included); a missing, empty
or damaged file, a folder, a JSON array or a value JSON has no type for is one line."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

import dataset.cache.build as token_cache
import dataset.sources as sources
from dataset import DataError, SFTDataset, build_cache_and_open
from tests.helpers.chat_rows import chat_line, make_chat, write_lines, write_rows


def cache_arrays(ds: SFTDataset) -> list[np.ndarray]:
    return [np.asarray(ds.tokens), np.asarray(ds.loss_mask), ds.offsets]


def test_gzip_file_gives_the_same_cache_as_the_plain_file(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "CHUNK_LINES", 5)
    lines = [chat_line(i) for i in range(23)]
    plain = build_cache_and_open(write_rows(tmp_path / "a.jsonl", lines), tokenizer, 64, num_proc=1)
    packed = build_cache_and_open(write_rows(tmp_path / "a.jsonl.gz", lines), tokenizer, 64, num_proc=2)
    assert len(packed) == 23
    for a, b in zip(cache_arrays(plain), cache_arrays(packed)):
        assert np.array_equal(a, b)


def test_gzip_bad_row_and_corrupt_gzip_are_one_line_errors(tokenizer, tmp_path):
    lines = [chat_line(i) for i in range(4)]
    lines[2] = '{"broken'
    path = write_rows(tmp_path / "b.jsonl.gz", lines)
    with pytest.raises(DataError, match=f"^{path}:3: invalid JSON"):
        build_cache_and_open(path, tokenizer, 64, num_proc=1)
    truncated = tmp_path / "c.jsonl.gz"
    truncated.write_bytes(gzip.compress(("\n".join(chat_line(i) for i in range(200)) + "\n").encode())[:300])
    with pytest.raises(DataError, match=f"^{truncated}: not a readable gzip file"):
        build_cache_and_open(truncated, tokenizer, 64, num_proc=1)


def test_missing_and_empty_files(tokenizer, tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        build_cache_and_open(tmp_path / "nope.jsonl", tokenizer, 128)
    (tmp_path / "empty.jsonl").write_text("\n \n", encoding="utf-8")
    with pytest.raises(DataError, match="empty.jsonl: data file is empty"):
        build_cache_and_open(tmp_path / "empty.jsonl", tokenizer, 128)
    with pytest.raises(DataError, match="no usable samples"):
        build_cache_and_open(write_lines(tmp_path / "bad.jsonl", ["{"]), tokenizer, 128, bad_data="skip", num_proc=1)


def test_data_file_problems_are_named(tokenizer, tmp_path):
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="folder: is a directory"):
        build_cache_and_open(tmp_path / "folder", tokenizer, 128)
    (tmp_path / "array.json").write_text(json.dumps([make_chat(1), make_chat(2)], indent=1), encoding="utf-8")
    with pytest.raises(DataError, match=r"array\.json: is one JSON array, not JSON Lines"):
        build_cache_and_open(tmp_path / "array.json", tokenizer, 128)
    (tmp_path / "line.json").write_text(json.dumps([make_chat(1), make_chat(2)]), encoding="utf-8")  # json.dump's
    with pytest.raises(DataError, match=r"line\.json: is one JSON array, not JSON Lines .* jq -c '\.\[\]'"):
        build_cache_and_open(tmp_path / "line.json", tokenizer, 128, bad_data="skip", num_proc=1)  # not a bad line
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + (json.dumps(make_chat(1)) + "\n" + json.dumps(make_chat(2)) + "\n").encode())
    assert len(build_cache_and_open(bom, tokenizer, 128, num_proc=1)) == 2


def test_a_compressed_or_parquet_file_under_a_plain_name_is_named(tmp_path):
    # read as text, its first line is "invalid UTF-8 at byte 1" / "invalid JSON": the name is what is wrong
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data.jsonl").write_bytes(gzip.compress((json.dumps(make_chat(1)) + "\n").encode()))
    pq.write_table(pa.Table.from_pylist([make_chat(1)]), tmp_path / "rows.jsonl")
    for name, kind, suffix, renamed in (("data.jsonl", "gzip-compressed", ".gz", "data.jsonl.gz"),
                                        ("rows.jsonl", "a parquet file", ".parquet", "rows.parquet")):
        with pytest.raises(DataError) as info:
            sources.check_data_file(tmp_path / name)
        assert str(info.value) == (f"{tmp_path / name}: is {kind}, but its name does not end in {suffix}: "
                                   f"rename it (e.g. {renamed})")


def test_a_utf16_file_is_named_as_such(tmp_path):
    # what Windows PowerShell's > writes: read as UTF-8, every line is "invalid UTF-8 at byte 0"
    (tmp_path / "win.jsonl").write_bytes((json.dumps(make_chat(1)) + "\n").encode("utf-16"))
    with pytest.raises(DataError) as info:
        sources.check_data_file(tmp_path / "win.jsonl")
    assert str(info.value) == (f"{tmp_path / 'win.jsonl'}: is UTF-16 text, not UTF-8: convert it, e.g. "
                               "iconv -f UTF-16 -t UTF-8 win.jsonl > win.utf8.jsonl")


def test_parquet_file_gives_the_same_cache_as_the_jsonl_file(tokenizer, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(token_cache, "CHUNK_LINES", 5)
    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 4)
    lines = [chat_line(i) for i in range(13)]
    pq.write_table(pa.Table.from_pylist([json.loads(line) for line in lines]), tmp_path / "a.parquet")
    plain = build_cache_and_open(write_rows(tmp_path / "a.jsonl", lines), tokenizer, 64, num_proc=1)
    table = build_cache_and_open(tmp_path / "a.parquet", tokenizer, 64, num_proc=2)
    for a, b in zip(cache_arrays(plain), cache_arrays(table)):
        assert np.array_equal(a, b)
    rows = [json.loads(line) for line in lines]
    rows[6]["conversations"][0]["role"] = "robot"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=f"^{tmp_path / 'bad.parquet'}:7: .*unknown role 'robot'"):
        build_cache_and_open(tmp_path / "bad.parquet", tokenizer, 64, num_proc=1)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="junk.parquet: not a readable parquet file"):
        build_cache_and_open(tmp_path / "junk.parquet", tokenizer, 64, num_proc=1)


def openai_tool_row(call_arguments: dict, tool_properties: dict, **extra) -> dict:
    """An OpenAI-format tool conversation: one call with ``call_arguments``, one tool with ``tool_properties``."""
    tool = {"type": "function", "function": {"name": "calc", "description": "Compute.",
                                             "parameters": {"type": "object", "properties": tool_properties}}}
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": call_arguments}}
    return {"tools": [tool], "messages": [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": None, "tool_calls": [call], **extra},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "42."},
    ]}


def parsed_rows(path: Path) -> list:
    from dataset.formats import parse_line

    return [parse_line(line.decode("utf-8")) for line in sources.open_lines(path)]


def test_parquet_structs_give_the_same_conversations_and_tokens_as_jsonl(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"system": "Be brief.", **openai_tool_row({"country": "Zorlia"}, {"country": {"type": "string"}})},
        openai_tool_row({"a": 2, "op": "+", "b": 3}, {"a": {"type": "integer"}, "op": {"type": "string"},
                                                      "b": {"type": "integer"}}, reasoning_content="Add."),
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    ]  # (from_pylist takes the columns from the first row's keys, the struct fields from all rows)
    jsonl = write_rows(tmp_path / "tools.jsonl", [json.dumps(row) for row in rows])
    table = pa.Table.from_pylist(rows)  # structs with the union of the rows' keys, null where a row lacks one
    assert "op" in str(table.schema.field("messages").type)
    pq.write_table(table, tmp_path / "tools.parquet")
    assert parsed_rows(tmp_path / "tools.parquet") == parsed_rows(jsonl)
    plain = build_cache_and_open(jsonl, tokenizer, 512, num_proc=1)
    columns = build_cache_and_open(tmp_path / "tools.parquet", tokenizer, 512, num_proc=1)
    assert len(columns) == 3
    for a, b in zip(cache_arrays(plain), cache_arrays(columns)):
        assert np.array_equal(a, b)


def test_a_null_in_a_parquet_struct_is_an_absent_key_and_a_json_string_or_map_keeps_it(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def parquet(name: str, rows: list, schema=None) -> Path:
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_path / name)
        return tmp_path / name

    def jsonl(name: str, rows: list) -> Path:
        return write_rows(tmp_path / name, [json.dumps(row) for row in rows])

    with_null = openai_tool_row({"city": "Velm", "unit": None}, {"city": {"type": "string"}})
    without = openai_tool_row({"city": "Velm"}, {"city": {"type": "string"}})
    # A struct: the null field is an absent key, as pyarrow's filler for keys other rows have is.
    assert parsed_rows(parquet("struct.parquet", [with_null])) == parsed_rows(jsonl("without.jsonl", [without]))
    # Arguments as a JSON string keep the null the data wrote.
    as_string = openai_tool_row(json.dumps({"city": "Velm", "unit": None}), {"city": {"type": "string"}})
    kept = parsed_rows(parquet("string.parquet", [as_string]))
    assert kept == parsed_rows(jsonl("with.jsonl", [with_null]))
    assert kept[0].messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Velm", "unit": None}
    # So does a map column: its keys are the row's own.
    function = pa.struct([("name", pa.string()), ("arguments", pa.map_(pa.string(), pa.string()))])
    message = pa.struct([("role", pa.string()), ("content", pa.string()),
                         ("tool_calls", pa.list_(pa.struct([("type", pa.string()), ("function", function)])))])
    schema = pa.schema([("messages", pa.list_(message))])
    mapped = {"messages": [{"role": "user", "content": "Go."}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": {"city": "Velm", "unit": None}}}]}]}
    assert parsed_rows(parquet("map.parquet", [mapped], schema)) == parsed_rows(jsonl("map.jsonl", [mapped]))


def test_a_parquet_row_holding_both_conversation_columns_is_that_rows_error(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = [make_chat(i)["conversations"] for i in range(3)]
    rows = [{"conversations": chats[0], "messages": None}, {"conversations": None, "messages": chats[1]},
            {"conversations": chats[2], "messages": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "one.parquet")  # a null column is an absent key
    jsonl = write_rows(tmp_path / "one.jsonl", [json.dumps({k: v for k, v in row.items() if v}) for row in rows])
    assert parsed_rows(tmp_path / "one.parquet") == parsed_rows(jsonl)
    rows[1]["conversations"] = chats[0]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "both.parquet")
    with pytest.raises(DataError) as info:
        build_cache_and_open(tmp_path / "both.parquet", tokenizer, 64, num_proc=1)
    assert str(info.value) == (f"{tmp_path / 'both.parquet'}:2: the line has both 'conversations' and 'messages'; "
                               "keep one of them (a line holds one conversation)")


def test_flat_and_nested_tool_calls_in_one_parquet_struct_are_each_one_form(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    nested = openai_tool_row({"a": 1}, {"a": {"type": "integer"}})
    flat = openai_tool_row({"a": 2}, {"a": {"type": "integer"}})
    flat["messages"][1]["tool_calls"] = [{"id": "c1", "name": "calc", "arguments": {"a": 2}}]
    table = pa.Table.from_pylist([nested, flat])  # one struct of calls: name, arguments and function, null where absent
    assert {"name", "arguments", "function"} <= {field.name for field in table.schema.field("messages").type
                                                  .value_type.field("tool_calls").type.value_type}
    pq.write_table(table, tmp_path / "calls.parquet")
    jsonl = write_rows(tmp_path / "calls.jsonl", [json.dumps(nested), json.dumps(flat)])
    assert parsed_rows(tmp_path / "calls.parquet") == parsed_rows(jsonl)


def test_a_functions_column_is_read_and_refused_where_a_row_fills_it(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{**make_chat(i), "functions": None} for i in range(3)]
    rows[1]["functions"] = [{"name": "f", "description": "F."}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "functions.parquet")
    with pytest.raises(DataError) as info:
        build_cache_and_open(tmp_path / "functions.parquet", tokenizer, 64, num_proc=1)
    assert str(info.value) == (
        f"{tmp_path / 'functions.parquet'}:2: top-level 'functions' (OpenAI's legacy name for tool definitions) is "
        """not read; put the definitions in 'tools', each as {"type": "function", "function": {...}}""")
    skipped = build_cache_and_open(tmp_path / "functions.parquet", tokenizer, 64, num_proc=1, bad_data="skip",
                                   cache_dir=tmp_path / "skip")
    assert len(skipped) == 2 and skipped.num_skipped == 1


def test_parquet_columns_the_trainer_does_not_read_do_not_matter(tokenizer, tmp_path):
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(chat_line(i)) for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "plain.parquet")
    extra = pa.Table.from_pylist(rows).append_column(
        "created", pa.array([datetime.datetime(2024, 1, 1, i) for i in range(6)], pa.timestamp("us"))
    ).append_column("image", pa.array([bytes([i, 255]) for i in range(6)], pa.binary()))
    pq.write_table(extra, tmp_path / "extra.parquet")
    plain = build_cache_and_open(tmp_path / "plain.parquet", tokenizer, 64, num_proc=1)
    for bad_data in ("error", "skip"):
        wide = build_cache_and_open(tmp_path / "extra.parquet", tokenizer, 64, num_proc=1, bad_data=bad_data,
                          cache_dir=tmp_path / bad_data)
        assert wide.num_skipped == 0
        for a, b in zip(cache_arrays(plain), cache_arrays(wide)):
            assert np.array_equal(a, b)


def test_a_parquet_value_json_has_no_type_for_makes_its_row_bad(tokenizer, tmp_path):
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    cases = {
        "timestamp": ({"role": "user", "content": "Hi", "sent": datetime.datetime(2024, 1, 1)},
                      "parquet column conversations[].sent holds a timestamp[us] value, which JSON has no type for"),
        "binary": ({"role": "user", "content": "Hi", "image": b"\x89PNG"},
                   "parquet column conversations[].image holds a binary value"),
    }
    for name, (message, problem) in cases.items():
        rows = [json.loads(chat_line(i)) for i in range(3)]
        rows[1]["conversations"][0] = message
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        with pytest.raises(DataError) as caught:
            build_cache_and_open(path, tokenizer, 64, num_proc=1)
        assert str(caught.value).startswith(f"{path}:2: {problem}") and "\n" not in str(caught.value)
        skipped = build_cache_and_open(path, tokenizer, 64, num_proc=1, bad_data="skip", cache_dir=tmp_path / name)
        assert len(skipped) == 2 and skipped.num_skipped == 1
    # A NaN float (here in tool-call arguments) is not JSON either: that row's error, as in a jsonl line.
    rows = [openai_tool_row({"x": 1.5}, {"x": {"type": "number"}}), openai_tool_row({"x": float("nan")}, {})]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "nan.parquet")
    with pytest.raises(DataError, match=r"nan\.parquet:2: invalid JSON \(NaN is not a JSON value\)"):
        build_cache_and_open(tmp_path / "nan.parquet", tokenizer, 512, num_proc=1)


def test_a_parquet_map_holding_a_key_twice_makes_its_row_bad(tokenizer, tmp_path):
    # A map column is a list of key-value pairs and may repeat a key, which a JSON object (and a
    # jsonl line, see test_formats) may not: that row's error, as the same jsonl line's is.
    import pyarrow as pa
    import pyarrow.parquet as pq

    function = pa.struct([("name", pa.string()), ("arguments", pa.map_(pa.string(), pa.string()))])
    message = pa.struct([("role", pa.string()), ("content", pa.string()),
                         ("tool_calls", pa.list_(pa.struct([("type", pa.string()), ("function", function)])))])
    rows = [{"messages": [{"role": "user", "content": "Go."}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": arguments}}]}]}
        for arguments in ([("city", "Velm")], [("city", "Velm"), ("city", "Oslo")], [("city", "Oslo")])]
    path = tmp_path / "map.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("messages", pa.list_(message))])), path)
    with pytest.raises(DataError) as caught:
        build_cache_and_open(path, tokenizer, 64, num_proc=1)
    assert str(caught.value) == (f"{path}:2: parquet column messages[].tool_calls[].function.arguments holds the key "
                                 "'city' twice in one map (which value is meant is not guessed)")
    skipped = build_cache_and_open(path, tokenizer, 64, num_proc=1, bad_data="skip", cache_dir=tmp_path / "skip")
    assert len(skipped) == 2 and skipped.num_skipped == 1


def test_a_parquet_schema_with_a_name_twice_is_the_files_error(tokenizer, tmp_path):
    # pyarrow writes a struct with a field name twice, and two columns of one name; a row's JSON
    # object cannot hold either, and pyarrow cannot read such a struct into Python at all.
    import pyarrow as pa
    import pyarrow.parquet as pq

    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("content", pa.string())])
    values = pa.array([[{"role": "user", "content": "Hi."}]], type=pa.list_(pa.struct([("role", pa.string()),
                                                                                         ("content", pa.string())])))
    roles, contents = values.flatten().field(0), values.flatten().field(1)
    doubled = pa.ListArray.from_arrays([0, 1], pa.StructArray.from_arrays([roles, contents, contents],
                                                                           fields=list(message)))
    path = tmp_path / "struct.parquet"
    pq.write_table(pa.Table.from_arrays([doubled], names=["messages"]), path)
    with pytest.raises(DataError) as caught:
        build_cache_and_open(path, tokenizer, 64, num_proc=1)
    assert str(caught.value) == (f"{path}: parquet schema holds the field 'content' twice in the struct of column "
                                 "messages[] (which value is meant is not guessed)")
    columns = tmp_path / "columns.parquet"
    pq.write_table(pa.Table.from_arrays([values, values], names=["messages", "messages"]), columns)
    with pytest.raises(DataError) as caught:
        build_cache_and_open(columns, tokenizer, 64, num_proc=1)
    assert str(caught.value) == (f"{columns}: parquet schema holds the column 'messages' twice (which value is meant "
                                 "is not guessed)")
