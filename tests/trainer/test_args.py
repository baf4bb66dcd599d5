"""trainer/args.py: every numeric flag declares its range beside it, a bad flag stops the start with
one line (not the usage first), and the flags module depends on no data or evaluation code."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.args import FlagParser, add_flag, build_parser, parse_args, range_problems

REPO = Path(__file__).resolve().parents[2]


def test_a_flag_out_of_its_range_is_one_line_without_the_usage(capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--learning_rate", "0", "--batch_size", "0"])
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == "error: --batch_size must be >= 1 (got 0); --learning_rate must be > 0 (got 0.0)\n"
    assert captured.out == ""


def test_an_error_line_naming_a_newline_stays_one_line(capsys):
    """The flags' error line and the trainer's (train_full_sft.fail) escape a newline in a value or a
    file name, as every control character: the error stays one line."""
    import train_full_sft

    def owned(args):
        return [f"--keep_best {args.keep_best}: refused by its owner"]

    with pytest.raises(SystemExit):
        parse_args(["--keep_best", "a\nb\x1b[2J"], checks=(owned,))
    assert capsys.readouterr().err == "error: --keep_best a\\nb\\x1b[2J: refused by its owner\n"
    assert train_full_sft.fail("error: data/a\nb.jsonl: no such file", 2) == 2
    assert capsys.readouterr().err == "error: data/a\\nb.jsonl: no such file\n"


def test_a_flag_argparse_refuses_is_one_line_too(capsys):
    for argv, message in ((["--fsdp", "2"], "error: argument --fsdp: invalid choice: 2 (choose from 0, 1)\n"),
                          (["--batch_size", "x"], "error: argument --batch_size: invalid int value: 'x'\n"),
                          (["--no_such_flag"], "error: unrecognized arguments: --no_such_flag\n")):
        with pytest.raises(SystemExit) as stopped:
            parse_args(argv)
        assert stopped.value.code == 2 and capsys.readouterr().err == message


def test_a_dist_timeout_beyond_a_week_is_refused_not_overflowed(capsys):
    """1e300 seconds would overflow `datetime.timedelta` (a traceback), and 1e10 fail the rendezvous at once."""
    for value in ("1e300", "1e10"):
        with pytest.raises(SystemExit) as stopped:
            parse_args(["--dist_timeout", value])
        assert stopped.value.code == 2
        assert capsys.readouterr().err == f"error: --dist_timeout must be <= 604800 (got {float(value)!r})\n"


def test_an_empty_path_is_refused_where_it_would_mean_the_current_directory(capsys, tmp_path):
    """`--save_dir "$OUT"` with OUT unset: with `export_hf.py --out_dir "" --overwrite` the current
    directory would be emptied and the export written there."""
    from tests.helpers.overfitted import script_in_process

    for flag in ("--save_dir", "--cache_dir"):
        with pytest.raises(SystemExit) as stopped:
            parse_args([flag, " "])
        assert stopped.value.code == 2
        assert capsys.readouterr().err == f"error: argument {flag}: an empty path: give a file or folder\n"
    (tmp_path / "notes.txt").write_text("mine")
    for name, flag in (("export_hf.py", "--out_dir"), ("inspect_data.py", "--html"), ("inspect_data.py", "--json_out"),
                       ("eval_sft.py", "--json_out"), ("make_demo_data.py", "--out-dir"), ("plot_loss.py", "--out"),
                       ("train_tokenizer.py", "--out-dir")):
        model = ["--model_path", "unread"] if name in ("export_hf.py", "eval_sft.py") else []
        overwrite = ["--overwrite"] if name == "export_hf.py" else []
        done = script_in_process(name, *model, flag, "", *overwrite, cwd=tmp_path)
        assert (done.returncode, done.stderr) == (
            2, f"error: argument {flag}: an empty path: give a file or folder (see {name} --help)\n"), name
    assert [path.name for path in tmp_path.iterdir()] == ["notes.txt"]


def test_a_flag_error_line_escapes_the_control_characters_of_the_values(capsys):
    # A value holding an escape sequence or a carriage return is shown escaped, never sent raw to the terminal.
    for argv, message in ((["--device", "cu\x1b[2Jda"], "error: --device cu\\x1b[2Jda: not supported "),
                          (["--save_dir", "x\x1b[2J", "a\rb.jsonl"], "error: unrecognized arguments: a\\rb.jsonl\n"),
                          (["--dtype", "bf\x1b[2J"], "error: argument --dtype: invalid choice: 'bf\\x1b[2J' ")):
        with pytest.raises(SystemExit) as stopped:
            parse_args(argv)
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.startswith(message), err
        assert not any(char in err for char in "\x1b\r"), err


def test_the_range_is_declared_with_the_flag():
    parser = FlagParser()
    add_flag(parser, "--ratio", type=float, default=0.5, at_least=0, at_most=1)
    add_flag(parser, "--eps", type=float, default=1e-6, above=0)
    add_flag(parser, "--steps", type=int, default=None, at_least=0)
    add_flag(parser, "--rate", type=float, default=0.0, at_least=0, below=1)
    parser.add_argument("--name", default="x")

    def problems(*argv):
        return range_problems(parser, parser.parse_args(list(argv)))

    assert problems() == []  # --steps unset: not checked
    assert problems("--ratio", "1", "--eps", "1e-9", "--steps", "0") == []
    assert problems("--ratio", "1.5") == ["--ratio must be <= 1 (got 1.5)"]
    assert problems("--rate", "0.99") == [] and problems("--rate", "1") == ["--rate must be < 1 (got 1.0)"]
    assert problems("--ratio", "-0.5", "--eps", "0", "--steps", "-1") == [
        "--ratio must be >= 0 (got -0.5)", "--eps must be > 0 (got 0.0)", "--steps must be >= 0 (got -1)"]
    assert problems("--ratio", "nan", "--eps=-inf") == [
        "--ratio must be a finite number (got nan)", "--eps must be a finite number (got -inf)"]

    named = FlagParser()  # a flag named by a short and a long option, a positional argument, another dest
    add_flag(named, "-n", "--count", type=int, default=1, at_least=1)
    add_flag(named, "rows", type=int, at_least=1)
    add_flag(named, "--top", dest="shown", type=int, default=3, at_least=1)
    assert range_problems(named, named.parse_args(["2"])) == []
    assert range_problems(named, named.parse_args(["-n", "0", "0", "--top", "0"])) == [
        "--count must be >= 1 (got 0)", "rows must be >= 1 (got 0)", "--top must be >= 1 (got 0)"]


def test_other_modules_checks_join_the_same_line(capsys):
    def owned(args):
        return [f"--keep_best {args.keep_best}: refused by its owner"] if args.keep_best else []

    assert parse_args(["--keep_best", "x"], checks=()).keep_best == "x"
    with pytest.raises(SystemExit):
        parse_args(["--keep_best", "x", "--epochs", "0"], checks=(owned,))
    assert capsys.readouterr().err == "error: --epochs must be >= 1 (got 0); --keep_best x: refused by its owner\n"


def test_every_numeric_flag_of_the_trainer_declares_a_range():
    numeric = [action for action in build_parser()._actions if action.type in (int, float) and not action.choices]
    assert len(numeric) == 35
    assert [action.dest for action in numeric if getattr(action, "bounds", None) is None] == []
    assert build_parser()._option_string_actions["--seed"].bounds.at_most == 2**32 - 1


def test_the_flags_import_no_data_evaluation_or_torch_code():
    loaded = subprocess.run([sys.executable, "-c", "import sys, trainer.args; print(sorted(sys.modules))"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout
    modules = eval(loaded)  # noqa: S307 - our own subprocess's printed list
    assert [name for name in modules if name.split(".")[0] in ("dataset", "model", "torch")
            or name.startswith("trainer.evaluation")] == []
    assert isinstance(build_parser(), argparse.ArgumentParser)


def test_the_flags_doc_shows_each_range():
    from trainer.args import flags_markdown

    text = flags_markdown()
    assert "| `--seed` | `42` | base seed; each rank uses seed + rank (range: 0 to 4294967295) |" in text
    assert "| `--learning_rate` | `0.0005` | peak LR of the cosine schedule (range: > 0) |" in text
    assert "| `--batch_size` | `16` | samples per process per micro-step (range: >= 1) |" in text
    assert "| `--dropout` | `0.0` | dropout on embeddings, attention and MLP outputs (range: >= 0, \\< 1) |" in text


def test_dropout_1_is_refused_by_the_flag_check_as_the_model_config_refuses_it(capsys):
    assert parse_args(["--dropout", "0.999"]).dropout == 0.999
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--dropout", "1"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "error: --dropout must be < 1 (got 1.0)\n"


def test_evaluation_flags_without_held_out_data_are_refused(capsys):
    # Without --eval_data_path nothing is evaluated: --eval_interval / --eval_generate_samples are refused, not skipped.
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--eval_interval", "5", "--eval_generate_samples", "2"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == ("error: --eval_interval 5 needs held-out data: give --eval_data_path; "
                                       "--eval_generate_samples 2 needs held-out data: give --eval_data_path\n")
    assert parse_args(["--eval_interval", "5", "--eval_data_path", str(REPO / "dataset/demo/sft_eval.jsonl")])
    assert parse_args(["--eval_interval", "0", "--eval_generate_samples", "0"]).eval_data_path is None
    # --eval_max_new_tokens without answers to generate is refused as well, with held-out data or without
    for held_out in ([], ["--eval_data_path", str(REPO / "dataset/demo/sft_eval.jsonl")]):
        with pytest.raises(SystemExit) as stopped:
            parse_args(["--eval_max_new_tokens", "32", *held_out])
        assert stopped.value.code == 2
        assert capsys.readouterr().err == ("error: --eval_max_new_tokens 32 sets the length of generated answers: "
                                           "give --eval_generate_samples N\n")


def test_a_glob_in_eval_data_path_is_named_with_the_files_it_matches(tmp_path, capsys):
    # else the line would be "data file not found", after the training data is tokenized
    for name in ("b.jsonl", "a.jsonl"):
        (tmp_path / name).write_text("{}\n")
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--eval_data_path", str(tmp_path / "*.jsonl")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        f"error: --eval_data_path {tmp_path / '*.jsonl'}: no such file; held-out files are named one by one, "
        f"comma-separated (only --data_path reads a glob): {tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}\n")


def test_help_shows_a_default_once_and_never_as_none():
    """The scripts' formatter (scripts/_common.py uses this one): a flag without a default (None) shows
    none, and a help that names its default is not followed by another."""
    words = " ".join(build_parser().format_help().split())
    assert "(default: None)" not in words
    assert "--cache_dir CACHE_DIR where the tokenized cache lives; default next to the data --" in words
    assert "--batch_size BATCH_SIZE samples per process per micro-step (default: 16)" in words
