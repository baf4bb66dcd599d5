"""scripts/chat.py, eval_sft.py and plot_loss.py: bad input is one `error:` line and exit 2."""

from tests.helpers.overfitted import script


def test_bad_input_gives_one_line_error_and_exit_2(trained, tmp_path):
    missing = script("chat.py", "--model_path", str(tmp_path / "nope"), "--prompt", "hi", "--device", "cpu")
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "does not exist" in missing.stderr
    assert missing.stderr.count("\n") == 1
    bad_flag = script("eval_sft.py", "--model_path", str(trained["run_dir"]), "--batch_size", "zero")
    assert bad_flag.returncode == 2 and bad_flag.stderr.startswith("error: ") and bad_flag.stderr.count("\n") == 1
    no_metrics = script("plot_loss.py", "--metrics", str(tmp_path / "run"), "--out", str(tmp_path / "x.png"))
    assert no_metrics.returncode == 2 and no_metrics.stderr == f"error: {tmp_path / 'run'}: metrics file not found\n"


def test_an_output_file_that_is_the_data_file_is_refused_and_the_data_kept(tmp_path):
    """`--html data.jsonl` (a slip of the tab key) would replace the data with the report."""
    from tests.helpers.overfitted import script_in_process

    data = tmp_path / "data.jsonl"
    data.write_text('{"conversations": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]}\n')
    for name, args in (("inspect_data.py", ["--data_path", str(data), "--html", str(data)]),
                       ("inspect_data.py", ["--data_path", str(tmp_path), "--json_out", str(tmp_path / "." / "data.jsonl")]),
                       ("eval_sft.py", ["--model_path", "unread", "--data_path", str(data), "--json_out", str(data)])):
        done = script_in_process(name, *args)
        flag, path = args[-2:]
        assert (done.returncode, done.stderr) == (2, f"error: {flag} {path} is the data file {data}: "
                                                     "writing it would overwrite the data; choose another file\n"), name
    assert data.read_text().startswith('{"conversations"')


# Run as `python scripts/NAME.py ARGS` runs it; then print the exit status and which of torch and
# transformers it had imported.
AS_A_SCRIPT = ("import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
               "except SystemExit as stop:\n"
               "    print(stop.code, sorted({name.split('.')[0] for name in sys.modules} & {'torch', 'transformers'}))\n")


def test_a_path_with_control_characters_is_escaped_on_the_one_error_line_without_importing_torch(tmp_path):
    """A name holding a newline or an escape sequence cannot split the error line or steer the terminal,
    and a flag's error still comes before torch's import (seconds)."""
    import subprocess
    import sys

    from tests.helpers.overfitted import REPO

    name = "d\x1b[2J\nx\r.jsonl"
    done = subprocess.run([sys.executable, "-c", AS_A_SCRIPT, str(REPO / "scripts" / "eval_sft.py"), "--model_path",
                           "unread", "--data_path", name, "--json_out", name], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    shown = "d\\x1b[2J\\nx\\r.jsonl"
    assert (done.stdout, done.stderr) == ("2 []\n", f"error: --json_out {shown} is the data file {shown}: writing "
                                                    "it would overwrite the data; choose another file\n")
