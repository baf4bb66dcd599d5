"""scripts/bench.py on a tiny config: every column is reported with sensible values (no speed targets)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.bench import COLUMNS, SCALING_COLUMNS, build_parser, causal_pairs, format_scaling_header

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "dataset" / "demo" / "sft_train.jsonl"


def run_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_flags():
    text = build_parser().format_help()
    for flag in ("--hidden_size", "--num_hidden_layers", "--max_seq_len", "--batch_size", "--accumulation_steps",
                 "--steps", "--warmup_steps", "--data_path", "--modes", "--dtypes", "--device", "--use_compile",
                 "--json_out", "--scaling", "--vocab_size"):
        assert flag in text


def test_tiny_benchmark_reports_every_column(tmp_path):
    data = tmp_path / "small.jsonl"
    with open(DEMO, encoding="utf-8") as source:
        data.write_text("".join(line for _, line in zip(range(200), source)), encoding="utf-8")
    json_out = tmp_path / "bench.json"
    completed = run_bench(
        "--hidden_size", "32", "--num_hidden_layers", "2", "--max_seq_len", "128", "--batch_size", "4",
        "--steps", "3", "--warmup_steps", "1", "--rounds", "3", "--modes", "minimind,dynamic", "--dtypes", "float32",
        "--device", "cpu", "--matmul_size", "256", "--data_path", str(data), "--cache_dir", str(tmp_path / "cache"),
        "--json_out", str(json_out),
    )
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    header = next(line for line in lines if line.startswith("mode "))
    for _, title, _ in COLUMNS:
        assert title in header
    assert any(line.startswith("summary:") for line in lines)
    assert "to first step: fresh cache" in completed.stdout

    report = json.loads(json_out.read_text(encoding="utf-8"))
    rows = {row["mode"]: row for row in report["results"]}
    assert set(rows) == {"minimind", "dynamic"}
    for row in rows.values():
        for key, _, _ in COLUMNS:
            assert key in row
            if not isinstance(row[key], str):
                assert math.isfinite(row[key]), (key, row[key])
        assert row["dtype"] == "float32"
        assert row["steps"] == 3
        assert 0 <= row["pad_fraction"] < 1
        for key in ("steps_per_s", "samples_per_s", "computed_tokens_per_s", "real_tokens_per_s",
                    "loss_tokens_per_s", "gflop_per_loss_token", "mfu", "peak_memory_mib"):
            assert row[key] > 0, key
        assert row["computed_tokens_per_s"] >= row["real_tokens_per_s"] >= row["loss_tokens_per_s"]
    assert rows["dynamic"]["pad_fraction"] < rows["minimind"]["pad_fraction"]
    assert rows["minimind"]["speedup_vs_minimind"] == 1.0
    # Full logits at every padded position: more FLOPs per loss token than the trainer's path.
    assert rows["minimind"]["gflop_per_loss_token"] > rows["dynamic"]["gflop_per_loss_token"]
    startup = report["startup"]
    assert startup["to_first_step_fresh_cache_s"] > 0 and startup["to_first_step_existing_cache_s"] > 0
    assert report["peak_flops"]["float32"] > 0


def test_attention_pairs_are_counted_per_row_or_per_packed_document():
    padded = {"input_ids": torch.zeros(2, 4, dtype=torch.long)}
    assert causal_pairs(padded) == 2 * (4 * 5 // 2)
    # One row: documents of 3 and 2 tokens, then a pad (position 0: a 1-token document).
    packed = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]])}
    assert causal_pairs(packed) == 6 + 3 + 1


def test_summary_compares_compiled_with_eager_and_bf16_with_fp32():
    from scripts.bench import summarize

    def row(mode, dtype, compiled, speed, warmup):
        return {"mode": mode, "dtype": dtype, "compiled": compiled, "loss_tokens_per_s": speed, "warmup_s": warmup,
                "speedup_vs_minimind": speed / 10.0}

    rows = [row("minimind", "float32", "no", 10.0, 1.0), row("minimind", "float32", "yes", 15.0, 30.0),
            row("grouped", "float32", "no", 100.0, 1.0), row("grouped", "float32", "yes", 120.0, 40.0),
            row("grouped", "bfloat16", "no", 110.0, 1.0), row("grouped", "bfloat16", "yes", 160.0, 50.0)]
    assert summarize(rows) == (
        "summary: best grouped bfloat16 compiled: 160 loss tok/s; 16.00x minimind bfloat16; "
        "bf16/fp32 loss tok/s: grouped 1.10; compiled/eager loss tok/s: minimind float32 1.50 (warm-up 30 s vs "
        "1 s eager), grouped float32 1.20 (warm-up 40 s vs 1 s eager), grouped bfloat16 1.45 (warm-up 50 s vs 1 s eager)"
    )


def test_scaling_reports_the_cache_build_and_the_restart(tmp_path):
    """One size and one restart: two fresh processes (each imports torch), so it stays short."""
    json_out = tmp_path / "scaling.json"
    completed = run_bench(
        "--scaling", "--scaling_sizes", "150", "--restarts", "1", "--hidden_size", "32", "--num_hidden_layers", "1",
        "--max_seq_len", "512", "--batch_size", "2", "--dtypes", "float32", "--device", "cpu", "--json_out", str(json_out),
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.lstrip().startswith("conversations")))
    assert lines[header] == format_scaling_header()
    assert all(title in lines[header] for title in ("build rows/s", "build RSS MiB", "workers RSS MiB", "restart s"))
    assert len(lines[header + 1].split()) == len(SCALING_COLUMNS) and lines[header + 1].split()[0] == "150"
    summary = lines[-1]
    assert summary.startswith("summary: restart to first step with 150 conversations: median ")
    for part in (" rows/s (", " rows/s per core) in ", "; build peak RSS ", "its tokenizer workers ", "restart peak RSS "):
        assert part in summary

    [row] = json.loads(json_out.read_text(encoding="utf-8"))["scaling"]
    assert row["conversations"] == row["samples"] == 150  # every demo conversation fits 512 tokens
    assert row["tokens"] > row["samples"] and row["data_mib"] > 0 and row["cache_mib"] > 0
    assert row["cache_build_rows_per_s"] == pytest.approx(row["conversations"] / row["cache_build_s"])
    assert row["cache_build_rows_per_core_s"] == pytest.approx(row["conversations"] / row["cache_build_cpu_s"])
    assert row["cache_build_processes"] >= 1 and row["cache_build_cpu_s"] > 0
    assert row["cache_build_peak_rss_mib"] >= row["cache_build_rss_before_mib"] > 0
    assert row["cache_build_workers_peak_rss_mib"] >= 0
    assert len(row["restart_s"]) == 1 and 0 < row["restart_dataset_s"] < row["restart_s"][0]
    assert row["restart_peak_rss_mib"] > 0


def test_prep_compares_our_preparation_with_minimind_s_on_plain_and_tool_rows(tmp_path):
    """--prep: both data sets, every way timed, the same token ids and masks as MiniMind's way (but
    for its newline after each end of turn), no speed target asserted here."""
    json_out = tmp_path / "prep.json"
    completed = run_bench("--prep", "--prep_rows", "60", "--max_seq_len", "1024", "--json_out", str(json_out))
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[-1].startswith("summary: ours / minimind rows per core: plain ") and " tool " in lines[-1]
    rows = {row["data"]: row for row in json.loads(json_out.read_text(encoding="utf-8"))["prep"]}
    assert set(rows) == {"plain", "tool"}
    for row in rows.values():
        assert row["rows"] == row["same_ids"] == row["same_masks"] == 60
        assert row["x_minimind"] == pytest.approx(row["ours_rows_per_core_s"] / row["minimind_rows_per_core_s"])
        assert all(row[f"{way}_rows_per_core_s"] > 0 for way in ("ours", "ours_whole", "minimind", "minimind_nopad"))
    assert rows["tool"]["tokens_per_row"] > 4 * rows["plain"]["tokens_per_row"]


def test_step_compare_times_the_three_steps_alternately_and_they_train_alike(tmp_path):
    data = tmp_path / "small.jsonl"
    with open(DEMO, encoding="utf-8") as source:
        data.write_text("".join(line for _, line in zip(range(60), source)), encoding="utf-8")
    json_out = tmp_path / "step.json"
    completed = run_bench("--step_compare", "--hidden_size", "32", "--num_hidden_layers", "1", "--max_seq_len", "256",
                          "--batch_size", "2", "--steps", "3", "--warmup_steps", "1", "--dtypes", "float32",
                          "--device", "cpu", "--data_path", str(data), "--cache_dir", str(tmp_path / "cache"),
                          "--json_out", str(json_out))
    assert completed.returncode == 0, completed.stderr
    report = json.loads(json_out.read_text(encoding="utf-8"))
    rows = {row["variant"]: row for row in report["step_compare"]}
    assert set(rows) == {"before", "now", "new"}
    assert all(row["same_weights"] and len(row["seconds"]) == 3 for row in rows.values())
    assert rows["before"]["ratio_median"] == 1.0 and report["checks"]["now_ms"] > 0 and report["checks"]["new_ms"] > 0
    assert completed.stdout.splitlines()[-1].startswith("summary: 6 conversations: before ")
