"""scripts/inspect_data.py end to end: the report of a mixture, dropped rows and why, the
tokenizer saved with --from_weight's weights, the HTML page (parsed, and screenshot in a real
browser when one is installed) and the terminal view."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dataset import load_tokenizer
from dataset.inspection.report import inspect_source
from dataset.mixture import parse_data_path
from dataset.inspection.segments import SEGMENTS
from dataset.inspection.token_view import HIGHLIGHT
from tests.dataset.test_inspect import TOOL_CHAT, check_page, demo_rows, write_rows
from tests.helpers.overfitted import script_in_process

REPO = Path(__file__).resolve().parents[2]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "inspect_data.py"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def inspect_here(*args: str) -> subprocess.CompletedProcess:
    """`inspect`'s result (exit status, stdout, stderr) from inspect_data.main, run in this process."""
    return script_in_process("inspect_data.py", *args)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """Demo rows split into a tools source and a plain one, plus a bad line in the plain one."""
    folder = tmp_path_factory.mktemp("mixture")
    lines = demo_rows(30)
    tools = write_rows(folder / "tools.jsonl", [line for line in lines if '"tools"' in line])
    plain = write_rows(folder / "plain.jsonl", [line for line in lines if '"tools"' not in line] + ["[1, 2]"])
    return tools, plain


def test_the_report_of_a_mixture_names_the_dropped_rows_and_what_looks_wrong(mixture, tmp_path):
    tools, plain = mixture
    result = inspect("--data_path", f"{tools}:2,{plain}", "--max_seq_len", "240", "--json_out", str(tmp_path / "r.json"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "source tools (" in out and "source plain (" in out and "all sources" in out
    tool_rows = len(tools.read_text().splitlines())
    assert f"dropped {tool_rows}: the tools block alone is longer than --max_seq_len (e.g. {tools}:1: " in out
    assert f"warning: tools: no supervised token in all {tool_rows} rows (--max_seq_len 240): this source trains nothing" in out
    assert "warning: plain: 1 bad rows" in out and "learn an empty think block" in out
    assert "(pictures of 3 rows: --html FILE or --terminal)" in out and "\x1b[" not in out  # stdout is not a terminal
    figures = json.loads((tmp_path / "r.json").read_text())
    tokenizer = load_tokenizer(None)
    for source, expected in zip(figures["sources"], parse_data_path(f"{tools}:2,{plain}")):
        report = inspect_source(expected, tokenizer, 240, 1000)
        assert source["name"] == expected.name and source["kept"] == report.kept and source["bad"] == report.bad
        assert [source["segments"][name]["supervised"] for name in SEGMENTS] == report.supervised.tolist()
        assert [source["segments"][name]["tokens"] for name in SEGMENTS] == report.tokens.tolist()
    assert figures["sources"][0]["dropped"] == {"the tools block alone is longer than --max_seq_len": tool_rows}
    assert figures["sources"][1]["supervised_empty_think_blocks"] > 0


def test_terminal_view_on_request(mixture):
    tools, _ = mixture
    result = inspect_here("--data_path", str(tools), "--max_seq_len", "1024", "--rows", "2", "--samples", "1",
                          "--terminal")
    assert result.returncode == 0, result.stderr
    assert "\x1b[38;5;16;48;5;221m" in result.stdout and "↵" in result.stdout
    assert "tokens per segment (supervised): system" in result.stdout


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    for args, message in ((["--data_path", str(tmp_path / "missing.jsonl")], "missing.jsonl: data file not found"),
                          (["--from_weight", str(tmp_path / "none")], "--from_weight"),
                          (["--max_seq_len", "0"], "--max_seq_len must be >= 2 (got 0)")):
        result = (inspect if "missing.jsonl" in message else inspect_here)(*args)  # one as the real command
        assert result.returncode == 2 and result.stderr.startswith("error: ") and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_flags_are_checked_as_the_trainer_does_and_an_empty_file_is_warned(mixture, tmp_path):
    tools, _ = mixture
    for flag, value in (("--max_seq_len", "1"), ("--rows", "-1"), ("--samples", "-2")):
        result = inspect_here("--data_path", str(tools), flag, value)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [
            f"error: {flag} must be >= {2 if flag == '--max_seq_len' else 0} (got {value})"]
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    result = inspect_here("--data_path", f"{tools},{empty}")
    assert result.returncode == 0, result.stderr
    assert f"warning: {empty}: data file is empty (training refuses this file)" in result.stdout.splitlines()


def test_an_output_file_that_cannot_be_written_is_refused_before_the_data_is_read_and_folders_are_made(mixture,
                                                                                                        tmp_path):
    tools, _ = mixture
    (tmp_path / "a_file").write_text("x")
    for flag, value, line in (("--html", tmp_path, f"--html {tmp_path} is a directory: give a file name"),
                              ("--json_out", tmp_path / "a_file" / "r.json",
                               f"--json_out {tmp_path / 'a_file' / 'r.json'}: {tmp_path / 'a_file'} is a file, not a folder")):
        result = inspect_here("--data_path", str(tmp_path / "missing.jsonl"), flag, str(value))  # not reached
        assert (result.returncode, result.stderr, result.stdout) == (2, f"error: {line}\n", "")
    result = inspect_here("--data_path", str(tools), "--json_out", str(tmp_path / "new" / "r.json"))
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "new" / "r.json").read_text(encoding="utf-8"))


def test_a_max_seq_len_whose_rope_tables_do_not_fit_is_the_trainers_one_line_before_the_data_is_read(tmp_path):
    """The trainer's own bound (trainer/model_setup.py): a missing data file is not reached."""
    from trainer.model_setup import host_memory_bytes

    far = 10**12
    result = inspect("--data_path", str(tmp_path / "missing.jsonl"), "--max_seq_len", str(far))
    peak, memory = 4 * far * 96 * 4 / 2**30, host_memory_bytes() / 2**30  # 96: the default model's head_dim
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"error: --max_seq_len {far}: the RoPE tables for {far} positions need {peak:.1f} GiB, more than a quarter of "
        f"this machine's {memory:.1f} GiB; --max_seq_len is the longest sample in tokens (default 512)"], result.stderr
    assert result.stdout == ""


def save_tokenizer(folder: Path, template_change=None) -> Path:
    folder.mkdir(parents=True)
    tokenizer = load_tokenizer(None)
    if template_change:
        tokenizer.chat_template = tokenizer.chat_template.replace(*template_change)
    tokenizer.save_pretrained(str(folder))
    return folder


def test_a_tokenizer_differing_from_the_weights_one_is_flagged(tmp_path):
    from transformers import AutoTokenizer

    shipped = REPO / "model" / "tokenizer"
    weights = save_tokenizer(tmp_path / "weights", ("# Tools", "# Functions"))
    (weights / "config.json").write_text("{}")
    assert AutoTokenizer.from_pretrained(str(weights)).chat_template != load_tokenizer(None).chat_template
    result = inspect_here("--tokenizer_path", str(shipped), "--from_weight", str(weights), "--rows", "5", "--samples",
                          "0")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("warning: --tokenizer_path"))
    assert f"differs from the tokenizer saved with --from_weight's weights ({weights}): chat template (first at" in line
    same = save_tokenizer(tmp_path / "run" / "model")
    (same / "config.json").write_text("{}")
    result = inspect_here("--tokenizer_path", str(shipped), "--from_weight", str(tmp_path / "run"), "--rows", "5",
                          "--samples", "0")
    assert "is the tokenizer saved with --from_weight's weights (same fingerprint)" in result.stdout
    assert "warning: --tokenizer_path" not in result.stdout
    result = inspect_here("--from_weight", str(weights), "--rows", "5", "--samples", "0")  # as training: the weights' own
    assert f"tokenizer: {weights} (saved with the weights, " in result.stdout and "warning: --tokenizer_path" not in result.stdout
    state_dict = tmp_path / "full_sft_512.pth"
    import torch

    torch.save({"x": torch.ones(1)}, state_dict)
    result = inspect_here("--from_weight", str(state_dict), "--rows", "5", "--samples", "0")
    assert "has no tokenizer saved with it; training uses the shipped one" in result.stdout


def test_the_weights_tokenizer_is_the_one_training_takes(tmp_path):
    import torch

    from model import MiniMindConfig, MiniMindForCausalLM
    from trainer.weights.inference import own_tokenizer_at
    from trainer.weights.read import read_weights

    tokenizer = load_tokenizer(None)
    model = MiniMindForCausalLM(MiniMindConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1))
    model.save_pretrained(str(tmp_path / "run" / "model"))
    tokenizer.save_pretrained(str(tmp_path / "run" / "model"))
    model.save_pretrained(str(tmp_path / "bare"))
    torch.save(model.state_dict(), tmp_path / "weights.pth")
    for path in (tmp_path / "run", tmp_path / "run" / "model", tmp_path / "bare", tmp_path / "weights.pth",
                 tmp_path / "run" / "model" / "model.safetensors"):
        assert own_tokenizer_at(str(path)) == read_weights(str(path)).tokenizer, path


def highlighted_pixels(png: Path) -> int:
    import matplotlib.image

    image = np.asarray(matplotlib.image.imread(str(png)))[..., :3]
    image = np.round(image * 255) if image.dtype.kind == "f" else image
    colour = np.array([int(HIGHLIGHT[k:k + 2], 16) for k in (1, 3, 5)])
    return int((np.abs(image.astype(np.int64) - colour).max(axis=-1) <= 3).sum())


def test_the_html_page_parses_and_shows_highlighted_tokens_in_a_browser(tmp_path):
    chats = write_rows(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": "Tell me about Zorlia."},
                      {"role": "assistant", "content": "Zorlia is a small country. " * 12,
                       "reasoning_content": "The user asks about Zorlia; I know it well. " * 6}]},
        {"messages": TOOL_CHAT.messages, "tools": TOOL_CHAT.tools},
    ])
    pages = {}
    for samples in (0, 2):
        pages[samples] = tmp_path / f"page{samples}.html"
        result = inspect_here("--data_path", str(chats), "--samples", str(samples), "--html", str(pages[samples]))
        assert result.returncode == 0 and f"wrote {pages[samples]} ({samples} samples)" in result.stdout, result.stderr
    report = inspect_source(parse_data_path(str(chats))[0], load_tokenizer(None), 512, samples=2)
    check_page(pages[2].read_text(encoding="utf-8"), report.samples)

    browser = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    if browser is None:
        pytest.skip("no chromium binary found (apt-get install chromium): the page was checked by parsing only")
    shots = {}
    for samples, page in pages.items():
        shots[samples] = tmp_path / f"page{samples}.png"
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shots[samples]}",
                        "--window-size=1200,900", page.as_uri()], capture_output=True, timeout=180, check=True)
    legend_only, with_samples = highlighted_pixels(shots[0]), highlighted_pixels(shots[2])
    assert legend_only > 500  # the legend's "supervised" key
    assert with_samples > legend_only + 5000, (legend_only, with_samples)  # the supervised tokens of the first sample


def test_control_characters_from_the_data_and_its_file_name_are_escaped(tmp_path):
    import os

    path = write_rows(tmp_path / "odd\r\x07.jsonl", [{"conversations": [
        {"role": "user", "content": "a\rb"}, {"role": "assistant", "content": "c\x1b[2Jd\x07"}]}])
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "inspect_data.py"), "--data_path", str(path),
                             "--samples", "1", "--terminal"], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_COLOR": "1"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"data: {tmp_path}/odd\\r\\x07.jsonl"
    assert f"── odd\\r\\x07 · {tmp_path}/odd\\r\\x07.jsonl:1 · 25 tokens, 13 supervised" in result.stdout
    assert "¦a¦\\r¦b¦" in result.stdout and "¦c¦\\x1b¦[¦2¦J¦d¦\\x07¦" in result.stdout
    assert not any(char in result.stdout for char in "\r\x07\x1b")
