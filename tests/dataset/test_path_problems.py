"""Data paths a careless user gives, each refused in one line naming the real problem or read as
meant: a byte order mark alone on line 1, carriage-return line endings, a pipe, a file in /dev, a
comma in a file name, a held-out file with a ':number' after it (dataset/sources.py,
dataset/mixture.py, dataset/cache/key.py, trainer/args.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dataset.mixture as mixture
import trainer.args as flags
from dataset import DataError
from dataset.cache.key import default_cache_root
from dataset.formats import LineError, load_row
from dataset.mixture import absolute_data_path, parse_data_path
from dataset.sources import check_data_file
from tests.helpers.trainer_launch import REPO, SCRIPT, TINY, clean_env
from trainer.args import parse_args

ROW = json.dumps({"conversations": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]})
BOM = b"\xef\xbb\xbf"


def refusal(path: Path) -> str:
    with pytest.raises(DataError) as caught:
        check_data_file(path)
    return str(caught.value)


def test_a_byte_order_mark_alone_on_line_1_is_named_not_empty(tmp_path):
    alone = tmp_path / "alone.jsonl"
    alone.write_bytes(BOM + b"\n\n")
    assert refusal(alone) == f"{alone}: holds only a UTF-8 byte order mark, no rows"
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(BOM + b"\n" + (ROW + "\n" + ROW + "\n").encode())
    check_data_file(rows)  # rows follow: line 1 is the bad row, named by what it holds
    with pytest.raises(LineError, match=r"^a UTF-8 byte order mark alone on the line, no JSON \(delete the line\)$"):
        load_row((BOM + b"\n").decode("utf-8"))
    assert load_row((BOM + ROW.encode()).decode("utf-8")) == json.loads(ROW)  # a mark before a row is accepted
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n \n")
    assert refusal(empty) == f"{empty}: data file is empty"


def test_carriage_return_line_endings_are_named(tmp_path):
    old_mac = tmp_path / "cr.jsonl"
    old_mac.write_bytes(f"{ROW}\r{ROW}\r".encode())
    assert refusal(old_mac) == (f"{old_mac}: its lines end in a carriage return alone (\\r, no \\n): it reads as one "
                                "line; convert the line endings, e.g. tr '\\r' '\\n' < in.jsonl > out.jsonl")
    windows = tmp_path / "crlf.jsonl"
    windows.write_bytes(f"{ROW}\r\n{ROW}\r\n".encode())
    check_data_file(windows)


def test_a_pipe_is_named_and_no_cache_goes_beside_a_file_in_dev(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    message = ("is a pipe or device, not a file: the data is read more than once (hashed, counted, tokenized); write "
               "it to a file and give that")
    assert refusal(fifo) == f"{fifo}: {message}"
    with pytest.raises(DataError) as caught:
        parse_data_path(str(fifo))
    assert str(caught.value) == f"{fifo}: {message}"
    for path in ("/dev/stdin", "/dev/fd/0", "/proc/self/fd/0"):
        with pytest.raises(DataError) as caught:
            default_cache_root(Path(path), None)
        assert str(caught.value) == (f"{path}: its token cache would be written beside it, in {os.path.dirname(path)}; "
                                     "give --cache_dir DIR for the cache, or write the data to a file")
        assert default_cache_root(Path(path), tmp_path / "c") == tmp_path / "c"
    assert default_cache_root(tmp_path / "a.jsonl", None) == tmp_path / ".cache"


@pytest.mark.slow
def test_a_stdin_redirected_from_a_file_trains_with_a_cache_dir_and_writes_nothing_in_dev(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(ROW + "\n" + ROW + "\n", encoding="utf-8")
    base = ["--data_path", "/dev/stdin", *TINY, "--max_steps", "1", "--save_dir", str(tmp_path / "run")]
    for extra, code in (([], 2), (["--cache_dir", str(tmp_path / "cache")], 0)):
        with open(data, "rb") as stdin:
            done = subprocess.run([sys.executable, SCRIPT, *base, *extra], cwd=REPO, env=clean_env(), stdin=stdin,
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == code, done.stderr
        if code == 2:
            assert done.stderr.strip().splitlines() == [
                "error: /dev/stdin: its token cache would be written beside it, in /dev; give --cache_dir DIR for the "
                "cache, or write the data to a file"]
        assert not os.path.exists("/dev/.cache")
    assert done.stdout.splitlines()[-1].startswith("done: the model is in")
    assert len([path for path in (tmp_path / "cache").iterdir() if not path.name.startswith(".")]) == 1


def test_a_comma_in_a_file_name(tmp_path):
    odd = tmp_path / "a,b.jsonl"
    odd.write_text(ROW + "\n", encoding="utf-8")
    (tmp_path / "x.jsonl").write_text(ROW + "\n", encoding="utf-8")
    for text, weight in ((str(odd), 1.0), (f"{odd}:2", 2.0)):  # one file, as written, with or without a weight
        [source] = parse_data_path(text)
        assert (source.files, source.weight) == ((odd,), weight)
        assert absolute_data_path(text) == text
    with pytest.raises(DataError) as caught:
        parse_data_path(f"{tmp_path}/x.jsonl,{odd}")
    assert str(caught.value) == (f"{tmp_path}/a: data file not found ({odd} is one file, but --data_path separates its "
                                 "sources at commas: rename it, or link it under a name without a comma)")
    assert flags.held_out_files(str(odd)) == [str(odd)]
    assert flags.held_out_files(f"{tmp_path}/x.jsonl,{tmp_path}/y.jsonl") == [f"{tmp_path}/x.jsonl", f"{tmp_path}/y.jsonl"]


def test_held_out_files_and_data_sources_split_a_comma_list_alike(tmp_path, capsys):
    # One rule (dataset.mixture.split_commas) for --data_path and --eval_data_path: a file whose name
    # holds a comma is one item, a plain list is split and its items stripped.
    odd = tmp_path / "a,b.jsonl"
    odd.write_text(ROW + "\n", encoding="utf-8")
    x, y = tmp_path / "x.jsonl", tmp_path / "y.jsonl"
    for text, items in ((str(odd), [str(odd)]), (f" {x}, {y},", [str(x), str(y)])):
        assert flags.held_out_files(text) == mixture.split_commas(text) == items
        assert parse_args(["--eval_data_path", text]).eval_data_path == absolute_data_path(text) == ",".join(items)
    # With a ':weight' too the comma file is one item: the held-out file is named, not split at its comma.
    assert flags.held_out_files(f"{odd}:2") == [f"{odd}:2"]
    with pytest.raises(SystemExit):
        parse_args(["--eval_data_path", f"{odd}:2"])
    assert capsys.readouterr().err.startswith(f"error: --eval_data_path {odd}:2: no such file, but {odd} is one: ")


def test_a_number_after_a_colon_is_named(tmp_path, capsys):
    data = tmp_path / "eval.jsonl"
    data.write_text(ROW + "\n", encoding="utf-8")
    with pytest.raises(SystemExit) as caught:
        parse_args(["--data_path", str(data), "--eval_data_path", f"{data}:2"])
    assert caught.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --eval_data_path {data}:2: no such file, but {data} is one: held-out files are read whole, without a "
        "':weight' (only --data_path weighs its sources) or a line number"]
    assert mixture.lone_weight_note(parse_data_path(f"{data}:2")) == (
        f"[data] note: --data_path {data}:2: ':2' is a mixture weight, not a line number; a single source is read "
        "whole, every row once per epoch, whatever its weight")
    assert mixture.lone_weight_note(parse_data_path(str(data))) is None
    other = tmp_path / "more.jsonl"
    other.write_text(ROW + "\n", encoding="utf-8")
    assert mixture.lone_weight_note(parse_data_path(f"{data}:2,{other}:1")) is None

