"""scripts/bench_scaling.py: the cache build and the restart, each in a fresh process."""

import json

import pytest

from scripts.bench_scaling import COLUMNS, format_header, main
from tests.helpers.bench_launch import REPO
from tests.helpers.in_process import run_in_process


def test_scaling_reports_the_cache_build_and_the_restart(tmp_path):
    """One size and one restart: two fresh processes (each imports torch), so it stays short. The
    script's own main() runs in the test's process: what it measures is those two fresh processes."""
    json_out = tmp_path / "scaling.json"
    argv = ["--sizes", "150", "--restarts", "1", "--hidden_size", "32", "--num_hidden_layers", "1", "--max_seq_len",
            "512", "--batch_size", "2", "--dtypes", "float32", "--device", "cpu", "--json_out", str(json_out)]
    completed = run_in_process(["bench_scaling.py", *argv], lambda: main(argv), cwd=REPO)
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.lstrip().startswith("conversations")))
    assert lines[header] == format_header()
    assert all(title in lines[header] for title in ("build rows/s", "build RSS MiB", "workers RSS MiB", "restart s"))
    assert len(lines[header + 1].split()) == len(COLUMNS) and lines[header + 1].split()[0] == "150"
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


def test_sizes_that_are_not_numbers_are_a_one_line_error(capsys):
    from scripts.bench_scaling import parse_options

    with pytest.raises(SystemExit) as stopped:
        parse_options(["--sizes", "1,x"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().startswith(
        "error: --sizes 1,x: expected numbers of conversations like 10000,100000 (see ")
