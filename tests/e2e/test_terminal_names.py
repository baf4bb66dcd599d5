"""A data file whose name holds control characters: the trainer's lines name it escaped, so the
name cannot redraw a line (``\\r``) or clear the screen (``\\x1b[2J``)."""

import re

import pytest

from tests.helpers.trainer_launch import REPO, TINY, run_trainer

pytestmark = pytest.mark.slow

NAME = "a\rb\x1b[2J"  # the file's stem; as the trainer prints it:
SHOWN = "a\\rb\\x1b[2J"
SOURCE = "a\\rb\\x1b2J"  # the source's name: its stem without brackets, escaped


def no_raw_controls(output: str) -> None:
    raw = sorted({char for char in output if char not in "\n\t" and (ord(char) < 0x20 or 0x7F <= ord(char) < 0xA0)})
    assert not raw, f"raw control characters {raw} in:\n{output[-3000:]}"


def test_a_run_names_a_data_file_with_control_characters_escaped(data, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    lines = (data / "train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    odd, plain = folder / f"{NAME}.jsonl", folder / "plain.jsonl"
    odd.write_text("".join(lines[:40]), encoding="utf-8")
    plain.write_text("".join(lines[40:80]), encoding="utf-8")
    result = run_trainer([*TINY, "--data_path", f"{odd},{plain}", "--save_dir", str(tmp_path / "run"),
                          "--cache_dir", str(tmp_path / "cache"), "--batch_size", "8", "--max_steps", "1",
                          "--save_interval", "0"])
    output = result.stdout + result.stderr
    no_raw_controls(output)
    assert re.search(rf"^tokenizing {re.escape(SHOWN)}\.jsonl: 40/40 rows \(100%\), ", result.stderr, re.M), result.stderr
    mixture = re.search(r"^\[data\] mixture per epoch: .*$", result.stdout, re.M).group(0)
    assert mixture == (f"[data] mixture per epoch: {SOURCE} 40 of 40 samples (weight 1, 1 file(s)); "
                       "plain 40 of 40 samples (weight 1, 1 file(s))")
    assert re.search(rf"^\[data\] {re.escape(SOURCE)}: .* kept, ", result.stdout, re.M), result.stdout
    assert re.search(rf"^step 1/1 .* \| {re.escape(SOURCE)} \d", result.stdout, re.M), result.stdout  # loss per source


def test_an_error_names_a_data_file_with_control_characters_escaped(data, tmp_path):
    bad = tmp_path / f"{NAME}.jsonl"
    bad.write_text((data / "train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[0] + "{oops\n",
                   encoding="utf-8")
    result = run_trainer([*TINY, "--data_path", str(bad), "--save_dir", str(tmp_path / "run"),
                          "--cache_dir", str(tmp_path / "cache")], check=False)
    output = result.stdout + result.stderr
    no_raw_controls(output)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith(f"error: {tmp_path / SHOWN}.jsonl:2: invalid JSON ("), output
    assert not re.search(rf'File "{re.escape(REPO)}/(?!\.venv/)', output)
