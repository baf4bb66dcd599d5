"""scripts/bench_step.py: the trainer's step with and without its finite checks, timed in turn."""

import json

from tests.helpers.bench_launch import demo_head, run_bench


def test_step_compare_times_the_three_steps_alternately_and_they_train_alike(tmp_path):
    data = demo_head(tmp_path, 60)
    json_out = tmp_path / "step.json"
    completed = run_bench("bench_step.py", "--hidden_size", "32", "--num_hidden_layers", "1", "--max_seq_len", "256",
                          "--batch_size", "2", "--steps", "3", "--warmup_steps", "1", "--dtypes", "float32",
                          "--data_path", str(data), "--cache_dir", str(tmp_path / "cache"), "--json_out", str(json_out))
    assert completed.returncode == 0, completed.stderr
    report = json.loads(json_out.read_text(encoding="utf-8"))
    rows = {row["variant"]: row for row in report["step_compare"]}
    assert set(rows) == {"before", "now", "new"}
    assert all(row["same_weights"] and len(row["seconds"]) == 3 for row in rows.values())
    assert rows["before"]["ratio_median"] == 1.0 and report["checks"]["now_ms"] > 0 and report["checks"]["new_ms"] > 0
    assert completed.stdout.splitlines()[-1].startswith("summary: 6 conversations: before ")
