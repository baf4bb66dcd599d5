"""The benchmark scripts' counted flags: a value out of range is one `error:` line and exit 2 when the
flags are parsed (the trainer's range where the trainer has the flag), not a traceback deep in a run.
Parsing only: nothing is measured."""

import pytest

from scripts import bench, bench_prep, bench_save, bench_scaling, profile_step, step_figures
from tests.helpers.bench_launch import DEMO

CASES = [
    (bench.parse_options, ["--steps", "0"], "--steps must be >= 1 (got 0)"),
    (bench.parse_options, ["--batch_size", "-1", "--hidden_size", "0"],
     "--hidden_size must be >= 1 (got 0); --batch_size must be >= 1 (got -1)"),
    (bench.parse_options, ["--max_seq_len", "1", "--warmup_steps", "-2", "--vocab_size", "0", "--seed", "-1"],
     "--max_seq_len must be >= 2 (got 1); --vocab_size must be >= 1 (got 0); --warmup_steps must be >= 0 (got -2); "
     "--seed must be >= 0 (got -1)"),
    (bench.parse_options, ["--rounds", "-1", "--matmul_size", "0"],
     "--rounds must be >= 0 (got -1); --matmul_size must be >= 1 (got 0)"),
    (profile_step.parse_options, ["--num_hidden_layers", "0", "--accumulation_steps", "0", "--top", "0"],
     "--num_hidden_layers must be >= 1 (got 0); --accumulation_steps must be >= 1 (got 0); --top must be >= 1 (got 0)"),
    (bench_scaling.parse_options, ["--restarts", "0", "--batch_size", "0"],
     "--restarts must be >= 1 (got 0); --batch_size must be >= 1 (got 0)"),
    (lambda argv: bench_prep.build_parser().parse_args(argv), ["--max_seq_len", "1", "--rows", "-1"],
     "--max_seq_len must be >= 2 (got 1); --rows must be >= 0 (got -1)"),
    (bench_save.parse, ["--num_attention_heads", "0", "--seq_len", "1", "--repeats", "0"],
     "--num_attention_heads must be >= 1 (got 0); --seq_len must be >= 2 (got 1); --repeats must be >= 1 (got 0)"),
    (lambda argv: step_figures.build_parser().parse_known_args(argv),
     ["--warmup_steps", "0", "--steps", "-1", "--measured_ms", "0", "--batch_size", "2"],
     "--warmup_steps must be >= 1 (got 0); --steps must be >= 1 (got -1); --measured_ms must be > 0 (got 0.0)"),
]


@pytest.mark.parametrize("parse, argv, line", CASES)
def test_counted_flags_out_of_range_are_one_line_and_exit_2(parse, argv, line, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse(argv)
    assert (stopped.value.code, capsys.readouterr().err) == (2, f"error: {line}\n")


def test_the_shared_flags_take_the_trainers_range():
    from trainer.args import flag_bounds

    actions = bench.build_parser()._option_string_actions
    for name in ("hidden_size", "num_hidden_layers", "max_seq_len", "batch_size", "accumulation_steps",
                 "warmup_steps", "seed"):
        assert actions[f"--{name}"].bounds == flag_bounds(name), name


def test_bench_memory_refuses_its_flags_in_one_line(capsys):
    from scripts import bench_memory

    for argv, line in ((["--processes", "0,x"], "error: --processes 0,x: expected process counts like 1,2,4"),
                       (["--processes", "0"], "error: --processes 0: every count must be 1 or more")):
        with pytest.raises(SystemExit) as stopped:
            bench_memory.main(argv)
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.startswith(f"{line} (see ") and err.count("\n") == 1, err


def test_a_json_out_that_cannot_be_written_is_refused_before_anything_is_measured(tmp_path, capsys):
    # a folder, or a path under a file: found when the flags are read, not as a traceback once the run is done
    (tmp_path / "notes").write_text("kept\n")
    under_a_file = tmp_path / "notes" / "bench.json"
    refusals = ((tmp_path, f"--json_out {tmp_path} is a directory: give a file name"),
                (under_a_file, f"--json_out {under_a_file}: {tmp_path / 'notes'} is a file, not a folder"))
    for parse in (bench.parse_options, bench_scaling.parse_options, bench_prep.main):
        for out, line in refusals:
            with pytest.raises(SystemExit) as stopped:
                parse(["--json_out", str(out), "--data_path", str(DEMO)])
            assert (stopped.value.code, capsys.readouterr().err) == (2, f"error: {line}\n"), (parse, out)
    assert (tmp_path / "notes").read_text() == "kept\n"
