"""scripts/bench_prep.py: our data preparation against MiniMind's, on plain and on tool rows."""

import json

import pytest

from tests.helpers.overfitted import script_in_process


def test_prep_compares_our_preparation_with_minimind_s_on_plain_and_tool_rows(tmp_path):
    """Both data sets, every way timed, the same token ids and masks as MiniMind's way (but for its
    newline after each end of turn), no speed target asserted here."""
    json_out = tmp_path / "prep.json"
    completed = script_in_process("bench_prep.py", "--rows", "60", "--max_seq_len", "1024", "--json_out",
                                  str(json_out))  # its main, in this process
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[2] == ("  ours = the build's chunk encoder; ours whole = the same with every text tokenized whole (no "
                        "piece remembered); general = the general path for every row (what the build runs for a "
                        "template the fast path does not cover); minimind = its __getitem__; mm no pads = its label "
                        "scan without the pads")
    assert lines[-1].startswith("summary: ours / minimind rows per core: plain ") and " tool " in lines[-1]
    rows = {row["data"]: row for row in json.loads(json_out.read_text(encoding="utf-8"))["prep"]}
    assert set(rows) == {"plain", "tool"}
    for row in rows.values():
        assert row["rows"] == row["same_ids"] == row["same_masks"] == 60
        assert row["x_minimind"] == pytest.approx(row["ours_rows_per_core_s"] / row["minimind_rows_per_core_s"])
        assert all(row[f"{way}_rows_per_core_s"] > 0 for way in ("ours", "ours_whole", "minimind", "minimind_nopad"))
    assert rows["tool"]["tokens_per_row"] > 4 * rows["plain"]["tokens_per_row"]
