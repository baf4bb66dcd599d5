"""model/__main__.py (`python -m model`): a config's parameter count; a size the config refuses is one line, exit 2."""

import runpy
import sys

import pytest

from tests.helpers.in_process import run_in_process


def python_m_model(*argv: str):
    """`python -m model ARGV` as the interpreter runs it (`__main__`), in this process."""
    def call():
        saved = sys.argv
        sys.argv = ["model", *argv]
        try:
            runpy.run_module("model", run_name="__main__", alter_sys=False)
        finally:
            sys.argv = saved
    return run_in_process(["python", "-m", "model", *argv], call)


def test_prints_the_parameter_count_of_the_config():
    done = python_m_model("--hidden_size", "64", "--num_hidden_layers", "2")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == "0.533M parameters (embedding 0.410M, attention 0.025M, mlp 0.098M, norm 0.000M)\n"


@pytest.mark.parametrize("argv, line", [
    (["--hidden_size", "66"], "error: MiniMindConfig: num_attention_heads (8) must divide hidden_size (66)"),
    (["--num_hidden_layers", "0"], "error: MiniMindConfig: num_hidden_layers must be a positive integer, got 0"),
    (["--use_moe", "2"], "error: argument --use_moe: invalid choice: 2 (choose from 0, 1) (see python -m model --help)"),
])
def test_a_size_the_config_refuses_is_one_line_and_exit_2(argv, line):
    done = python_m_model(*argv)
    assert (done.returncode, done.stderr, done.stdout) == (2, line + "\n", "")
