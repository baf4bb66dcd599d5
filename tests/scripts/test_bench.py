"""scripts/bench.py on a tiny config: every column is reported with sensible values (no speed targets)."""

import json
import math

from scripts.bench import COLUMNS, build_parser, summarize
from tests.helpers.bench_launch import demo_head
from tests.helpers.overfitted import script, script_in_process


def test_help_lists_the_flags():
    text = build_parser().format_help()
    for flag in ("--hidden_size", "--num_hidden_layers", "--max_seq_len", "--batch_size", "--accumulation_steps",
                 "--steps", "--warmup_steps", "--data_path", "--modes", "--dtypes", "--device", "--use_compile",
                 "--json_out", "--vocab_size", "--matmul_size"):
        assert flag in text


def test_tiny_benchmark_reports_every_column(tmp_path):
    data = demo_head(tmp_path, 200)
    json_out = tmp_path / "bench.json"
    completed = script_in_process(  # its main, in this process: what it reports, not how it exits
        "bench.py", "--hidden_size", "32", "--num_hidden_layers", "2", "--max_seq_len", "128", "--batch_size", "4",
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
        assert 0 < row["host_share"] <= 1  # on a CPU the host's issue time is the step's time
    assert rows["dynamic"]["pad_fraction"] < rows["minimind"]["pad_fraction"]
    assert rows["minimind"]["speedup_vs_minimind"] == 1.0
    # Full logits at every padded position: more FLOPs per loss token than the trainer's path.
    assert rows["minimind"]["gflop_per_loss_token"] > rows["dynamic"]["gflop_per_loss_token"]
    startup = report["startup"]
    assert startup["to_first_step_fresh_cache_s"] > 0 and startup["to_first_step_existing_cache_s"] > 0
    assert report["peak_flops"]["float32"] > 0


def test_summary_compares_compiled_with_eager_and_bf16_with_fp32():
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


def test_a_model_shape_the_trainer_refuses_is_one_line_and_exit_2_not_a_traceback(tmp_path):
    # 7 does not split into the 8 default heads: the trainer's ConfigError, run as `python scripts/bench.py`
    data = demo_head(tmp_path, 20)
    for name, args in (("bench.py", ["--steps", "1", "--warmup_steps", "0", "--modes", "dynamic", "--dtypes", "float32",
                                     "--device", "cpu"]),
                       ("step_figures.py", [])):
        done = script(name, "--hidden_size", "7", "--data_path", str(data), "--cache_dir", str(tmp_path / "cache"), *args)
        assert (done.returncode, done.stderr.splitlines()[-1]) == (
            2, "error: MiniMindConfig: head_dim must be a positive integer, got 0"), name
        assert "Traceback" not in done.stderr, name  # before it: the data's progress lines only
