"""The scripts: bad input is one `error:` line and exit 2 (chat.py, eval_sft.py, plot_loss.py, inspect_data.py; every entry point)."""

import ast

import torch

from model import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.overfitted import REPO, script, script_in_process
from trainer.weights.inference import load_tokenizer_for_model


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


def test_a_tokenizer_smaller_than_the_weights_vocabulary_is_refused_as_the_trainer_refuses_it(trained, tmp_path):
    """Weights that name no tokenizer (a MiniMind .pth) with 64 embedding rows more than the shipped
    tokenizer has tokens: another tokenizer's ids would mean other text (chat printed an empty answer,
    eval a full result). The weights' own tokenizer may be smaller than a padded vocab_size."""
    tokens = len(trained["tokenizer"])
    model = MiniMindForCausalLM(MiniMindConfig(vocab_size=tokens + 64, hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2))
    pth = tmp_path / "full_sft_32.pth"
    torch.save({k: v.half() for k, v in model.state_dict().items()}, pth)
    refused = (2, f"error: the tokenizer has {tokens} tokens but the weights' vocab_size is {tokens + 64} ({pth}): "
                  "use the tokenizer the weights were trained with\n")
    for name, args in (("chat.py", ["--prompt", "hi"]), ("eval_sft.py", ["--data_path", str(trained["data"])]),
                       ("export_hf.py", ["--out_dir", str(tmp_path / "export")])):
        done = script_in_process(name, "--model_path", str(pth), "--device", "cpu", *args)
        assert (done.returncode, done.stderr) == refused, name
    assert not (tmp_path / "export").exists()
    assert len(load_tokenizer_for_model(trained["hf_dir"], vocab_size=tokens + 64)) == tokens


def test_every_script_runs_its_main_through_run_main():
    """`run_main` turns the trainer's user errors (a model shape it refuses, a bad path or file) into one
    `error:` line and exit 2: every script's entry point goes through it, the benchmarks' included."""
    scripts = sorted(path for path in (REPO / "scripts").glob("*.py") if not path.name.startswith("_"))
    entries = {}
    for path in scripts:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
                entries[path.name] = [ast.unparse(statement) for statement in node.body]
    assert len(entries) == len(scripts) > 10
    assert {name: body for name, body in entries.items() if body != ["run_main(main)"]} == {}
