"""scripts/plot_loss.py: the last line of each step, the latest run of a file, the PNG and its curves."""

import json

import pytest


def metric_lines(steps, loss_offset=0.0, kind="train"):
    for step in steps:
        if kind == "train":
            yield {"kind": "train", "step": step, "epoch": 0, "loss": 5.0 - 0.01 * step + loss_offset,
                   "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0 + step, "time": float(step)}
        else:
            yield {"kind": "eval", "step": step, "eval_loss": 4.0 - 0.01 * step + loss_offset}


def test_dedupe_keeps_the_last_line_of_each_step():
    from scripts.plot_loss import dedupe_metrics

    crashed = [*metric_lines(range(1, 16)), *metric_lines([10], kind="eval")]
    resumed = [*metric_lines(range(11, 21), loss_offset=1.0), *metric_lines([10, 20], kind="eval", loss_offset=1.0)]
    curves = dedupe_metrics(crashed + resumed)
    assert [r["step"] for r in curves["train"]] == list(range(1, 21))
    assert [r["step"] for r in curves["eval"]] == [10, 20]
    by_step = {r["step"]: r["loss"] for r in curves["train"]}
    assert by_step[10] == pytest.approx(4.9) and by_step[11] == pytest.approx(5.89)  # resumed values win
    assert curves["eval"][0]["eval_loss"] == pytest.approx(4.9)


def test_plot_draws_the_latest_run_of_a_file_two_runs_wrote_unless_asked(tmp_path, capsys, monkeypatch):
    import scripts.plot_loss as plot_loss

    first = [{**row, "run_id": "a"} for row in metric_lines(range(1, 11))]
    second = [{**row, "run_id": "b"} for row in metric_lines(range(1, 6), loss_offset=2.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first + second))
    drawn = {}
    monkeypatch.setattr(plot_loss, "plot", lambda curves, out, title: drawn.update(curves) or [])
    assert plot_loss.main(["--metrics", str(tmp_path)]) == 0
    assert [(r["step"], r["run_id"]) for r in drawn["train"]] == [(step, "b") for step in range(1, 6)]
    assert capsys.readouterr().out.splitlines()[0] == (
        "note: plotted run b (5 of 15 lines); 1 other run(s) in this file are left out (--runs all plots every line)")
    assert plot_loss.main(["--metrics", str(tmp_path), "--runs", "all"]) == 0
    assert [r["step"] for r in drawn["train"]] == list(range(1, 11))


def test_a_rollbacks_run_is_drawn_with_the_runs_it_left_up_to_where_it_left_them(tmp_path, capsys, monkeypatch):
    import scripts.plot_loss as plot_loss

    first = [{**row, "run_id": "a"} for row in metric_lines(range(1, 11))]
    second = [{**row, "run_id": "b"} for row in metric_lines(range(5, 9), loss_offset=1.0)]  # rolled back to 4
    third = [{**row, "run_id": "c"} for row in metric_lines(range(7, 13), loss_offset=2.0)]  # rolled back to 6
    second[0]["rolled_back_from"] = {"run_id": "a", "step": 4}
    third[0]["rolled_back_from"] = third[3]["rolled_back_from"] = {"run_id": "b", "step": 6}  # two processes
    other = [{**row, "run_id": "z"} for row in metric_lines(range(1, 3))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in other + first + second + third))
    drawn = {}
    monkeypatch.setattr(plot_loss, "plot", lambda curves, out, title: drawn.update(curves) or [])
    assert plot_loss.main(["--metrics", str(tmp_path)]) == 0
    assert [(r["step"], r["run_id"]) for r in drawn["train"]] == [
        (1, "a"), (2, "a"), (3, "a"), (4, "a"), (5, "b"), (6, "b"), *((step, "c") for step in range(7, 13))]
    assert capsys.readouterr().out.splitlines()[0] == (
        "note: plotted run c, with run b up to step 6, with run a up to step 4 (12 of 22 lines); 1 other run(s) in "
        "this file are left out (--runs all plots every line)")


def test_plot_writes_a_png_and_rejects_empty_metrics(tmp_path, capsys):
    from scripts.plot_loss import main

    lines = [*metric_lines(range(1, 31)), *metric_lines([10, 20, 30], kind="eval"), *metric_lines(range(21, 41))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["--metrics", str(tmp_path), "--out", str(tmp_path / "loss.png")]) == 0
    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit) as done:
        main(["--metrics", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "x.png")])
    assert done.value.code == 2 and "error:" in capsys.readouterr().err


def test_plot_draws_per_source_train_losses_per_file_eval_curves_and_accuracies(tmp_path):
    from scripts.plot_loss import dedupe_metrics, plot

    train = [{**row, "loss/general": 5.0, "loss/tools": 4.0} for row in metric_lines(range(1, 11))]
    evals = [{"kind": "eval", "step": s, "eval_loss": 4.0, "eval_loss/a": 4.1, "eval_loss/b": 3.9,
              "eval_token_accuracy": 0.1 * s, "eval_exact_match/a": 0.0, "eval_loss_tokens": 90,
              "best_metric": "eval_loss", "best_step": 5, "new_best": s == 5} for s in (5, 10)]
    labels = plot(dedupe_metrics(train + evals), tmp_path / "loss.png", "t")
    assert labels == ["train loss", "train loss/general", "train loss/tools", "eval loss", "eval loss/a",
                      "eval loss/b", "eval token accuracy", "eval exact match/a"]
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_lines_of_json_but_not_of_metrics_are_skipped_and_said(tmp_path, capsys):
    # a "kind" or "run_id" that is not a string cannot key a curve or a run; a best_step without its
    # best_metric has no label
    from scripts.plot_loss import main

    lines = [*metric_lines(range(1, 4)), {"kind": ["train"], "step": 4, "loss": 1.0},
             {"kind": "train", "step": 5, "loss": 1.0, "run_id": {"a": 1}},
             {"kind": "eval", "step": 3, "eval_loss": 2.0, "best_step": 3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["--metrics", str(tmp_path), "--out", str(tmp_path / "loss.png")]) == 0
    assert capsys.readouterr().err == f"warning: {tmp_path / 'metrics.jsonl'}: skipped 2 malformed line(s) (first: line 4)\n"
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_a_step_beyond_what_a_float_holds_exactly_is_not_a_step():
    from scripts.plot_loss import is_step

    assert is_step(2**53) and not is_step(2**53 + 1) and not is_step(10**400) and not is_step(-1)


def test_a_boolean_step_is_not_a_step(tmp_path, capsys):
    # true is an int to Python: taken as step 1, it would replace step 1's line of the curve
    from scripts.plot_loss import dedupe_metrics, main, read_metrics

    lines = [*metric_lines(range(1, 4)), {"kind": "train", "step": True, "loss": 9.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert capsys.readouterr().err == f"warning: {tmp_path / 'metrics.jsonl'}: skipped 1 malformed line(s) (first: line 4)\n"
    assert [r["loss"] for r in dedupe_metrics(records)["train"]] == [4.99, 4.98, 4.97]
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": False}) + "\n" + json.dumps(lines[-1]) + "\n")
    with pytest.raises(SystemExit) as done:
        main(["--metrics", str(tmp_path), "--out", str(tmp_path / "loss.png")])
    assert (done.value.code, capsys.readouterr().err) == (
        2, f"error: {tmp_path / 'metrics.jsonl'}: none of its 2 lines is a metrics line (2 objects without an integer "
           '"step"): not a metrics.jsonl written by train_full_sft.py\n')


def test_metrics_without_a_finite_loss_are_one_line_not_an_empty_plot(tmp_path, capsys):
    # every logged interval skipped (non-finite steps log "loss": null): nothing to draw, said in one line
    from scripts.plot_loss import main

    lines = [{**line, "loss": None} for line in metric_lines(range(1, 4))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(SystemExit) as done:
        main(["--metrics", str(tmp_path), "--out", str(tmp_path / "loss.png")])
    assert done.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {tmp_path / 'metrics.jsonl'}: no finite loss in its 3 train lines (every step skipped?): nothing to plot"]
    assert not (tmp_path / "loss.png").exists()


def test_eval_lines_without_a_finite_loss_add_no_loss_to_draw(tmp_path, capsys):
    # an eval line's "eval_loss_tokens" is a count of tokens, not a loss: with every train and eval
    # loss null the loss panel has nothing to draw, refused as a file of train lines alone is
    from scripts.plot_loss import main

    lines = [{**line, "loss": None} for line in metric_lines(range(1, 4))]
    lines += [{"kind": "eval", "step": 3, "eval_loss": None, "eval_loss_tokens": 90, "eval_token_accuracy": 0.2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(SystemExit) as done:
        main(["--metrics", str(tmp_path), "--out", str(tmp_path / "loss.png")])
    assert (done.value.code, capsys.readouterr().err) == (
        2, f"error: {tmp_path / 'metrics.jsonl'}: no finite loss in its 3 train lines (every step skipped?): "
           "nothing to plot\n")
    assert not (tmp_path / "loss.png").exists()


def test_an_out_file_that_cannot_be_written_is_refused_before_the_plot_with_the_reason(tmp_path, capsys):
    # a file standing where a folder of --out would be, or a folder named like the PNG: the OSError's
    # "File exists" or "Is a directory" named no flag and no reason
    from scripts.plot_loss import main

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metric_lines(range(1, 4))))
    (tmp_path / "notes").write_text("kept\n")
    (tmp_path / "old.png").mkdir()
    for out, reason in ((tmp_path / "notes" / "loss.png", f"{tmp_path / 'notes'} is a file, not a folder"),
                        (tmp_path / "notes" / "a" / "loss.png", f"{tmp_path / 'notes'} is a file, not a folder"),
                        (tmp_path / "old.png", "is a directory: give a file name")):
        with pytest.raises(SystemExit) as done:
            main(["--metrics", str(tmp_path), "--out", str(out)])
        separator = " " if reason.startswith("is a") else ": "
        assert (done.value.code, capsys.readouterr().err) == (2, f"error: --out {out}{separator}{reason}\n"), out
    assert (tmp_path / "notes").read_text() == "kept\n" and not any((tmp_path / "old.png").iterdir())


def test_a_file_without_metrics_lines_is_refused_with_what_it_holds(tmp_path, capsys):
    # one line, exit 2, no warning first: an empty file, or N lines counted by what they are
    from scripts.plot_loss import main

    conversation = {"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    files = {
        "empty.jsonl": ("", "empty file (0 bytes): no metrics line to plot"),
        "data.jsonl": (json.dumps(conversation) + "\n\n" + json.dumps({"messages": []}) + "\n",
                       "none of its 3 lines is a metrics line (2 conversation rows, 1 blank): not a metrics.jsonl "
                       "written by train_full_sft.py"),
        "result.json": (json.dumps({"loss": 0.5, "by_task": {}}, indent=2) + "\n",
                        "none of its 4 lines is a metrics line (4 not JSON): not a metrics.jsonl written by "
                        "train_full_sft.py"),
        "other.jsonl": ("[1, 2]\n" + json.dumps({"step": "3"}) + "\n" + json.dumps({"step": 3, "kind": 1}) + "\n",
                        "none of its 3 lines is a metrics line (1 JSON value that is not an object, 1 object without "
                        "an integer \"step\", 1 object whose \"kind\" or \"run_id\" is not a string): not a "
                        "metrics.jsonl written by train_full_sft.py"),
        "blank.jsonl": ("\n", "its one line is not a metrics line (1 blank): not a metrics.jsonl written by "
                               "train_full_sft.py"),
    }
    for name, (text, message) in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        with pytest.raises(SystemExit) as done:
            main(["--metrics", str(tmp_path / name), "--out", str(tmp_path / "x.png")])
        assert (done.value.code, capsys.readouterr().err) == (2, f"error: {tmp_path / name}: {message}\n"), name


def test_json_lines_that_python_cannot_decode_are_skipped_and_said_not_a_traceback(tmp_path, capsys, monkeypatch):
    # json.loads raises RecursionError for nesting deeper than the stack, ValueError for an integer of
    # over 4300 digits: lines that are not JSON to this reader, as a line cut by a crash is
    import scripts.plot_loss as plot_loss

    monkeypatch.setattr(plot_loss, "plot", lambda curves, out, title: [])
    lines = [json.dumps(row) for row in metric_lines(range(1, 4))] + ["[" * 100_000, '{"step": ' + "1" * 5000 + "}"]
    (tmp_path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    assert plot_loss.main(["--metrics", str(tmp_path)]) == 0
    assert capsys.readouterr().err == f"warning: {tmp_path / 'metrics.jsonl'}: skipped 2 malformed line(s) (first: line 4)\n"
    (tmp_path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines[3:]))
    with pytest.raises(SystemExit) as done:
        plot_loss.main(["--metrics", str(tmp_path)])
    assert (done.value.code, capsys.readouterr().err) == (
        2, f"error: {tmp_path / 'metrics.jsonl'}: none of its 2 lines is a metrics line (2 not JSON): not a "
           "metrics.jsonl written by train_full_sft.py\n")


def test_a_boolean_value_is_no_point_of_a_curve():
    # true is 1 to Python: "lr": true would be drawn as a learning rate of 1.0
    from scripts.plot_loss import _series

    records = [{"step": 1, "lr": 0.001}, {"step": 2, "lr": True}, {"step": 3, "lr": 0.002}, {"step": 4, "lr": False},
               {"step": 5, "lr": 10**400}]  # an integer beyond the float range: no point, not an OverflowError
    assert _series(records, "lr") == ([1, 3], [0.001, 0.002])


def test_a_key_whose_values_are_no_numbers_is_no_curve():
    from scripts.plot_loss import keys_with_prefix

    records = [{"step": 1, "loss": 10**400, "loss/a.jsonl": 2.0, "loss/b.jsonl": True, "eval_loss": 1.0}]
    assert keys_with_prefix(records, ("loss",)) == ["loss/a.jsonl"]
