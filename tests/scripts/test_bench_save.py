"""scripts/bench_save.py: the three loops it times, and its flag checks."""

import pytest

from scripts import bench_save
from tests.helpers.overfitted import script_in_process
from trainer.loop import saves, state

TINY = ["--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "4", "--num_key_value_heads", "2",
        "--steps", "2", "--seq_len", "8", "--repeats", "1", "--device", "cpu"]


def test_the_bench_times_no_save_a_synchronous_and_a_background_save(tmp_path, capsys):
    assert bench_save.main([*TINY, "--work_dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model: 0.") and "2 steps of 8 tokens, median of 1" in lines[0]
    assert lines[1].split() == ["save", "loop", "s", "stall", "s", "call", "s", "write", "s"]
    rows = {line.split()[0]: [float(x) for x in line.split()[-4:]] for line in lines[2:]}
    assert list(rows) == ["no", "synchronous", "background"] and rows["no"][1] == 0.0
    assert rows["synchronous"][2] == rows["synchronous"][3] > 0  # the loop waited for the whole save
    assert list(tmp_path.iterdir()) == []  # its files are removed
    assert saves.resume_state is state.resume_state  # a later run in this process saves its whole state


def test_help_describes_the_bench_in_its_whole_first_sentence_and_gives_the_models_shape(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_save.parse(["--help"])
    assert exit_info.value.code == 0
    words = " ".join(capsys.readouterr().out.split())
    assert ("How long a save stalls the training loop: the trainer's background save (trainer/loop/saves.py: a "
            "host copy, then a writer thread) against a synchronous one (the same files written before the loop "
            "goes on). options:") in words
    assert ("--hidden_size HIDDEN_SIZE the model's width (default: 1024) --num_hidden_layers NUM_HIDDEN_LAYERS "
            "blocks (default: 8) --num_attention_heads NUM_ATTENTION_HEADS query heads (default: 16) "
            "--num_key_value_heads NUM_KEY_VALUE_HEADS k/v heads (default: 8)") in words


def test_too_few_steps_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_save.parse(["--steps", "1"])
    assert exit_info.value.code == 2
    assert "--steps must be >= 2" in capsys.readouterr().err


def test_a_shape_the_model_refuses_is_one_line_and_nothing_is_left(tmp_path):
    done = script_in_process("bench_save.py", *TINY, "--hidden_size", "36", "--num_attention_heads", "8",
                             "--work_dir", str(tmp_path))
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", "error: MiniMindConfig: num_attention_heads (8) must divide hidden_size (36)\n")
    assert list(tmp_path.iterdir()) == []
