"""scripts/_common.py: the scripts' --help shows a flag's default once, and never as None."""

import importlib

import pytest

from scripts._common import ArgumentParser


def test_help_shows_a_default_unless_the_help_names_it_or_there_is_none():
    parser = ArgumentParser(prog="bench.py")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--matmul_size", type=int, default=None,
                        help="side of the square matmul (default: 2048 on CPU, 8192 on a GPU)")
    parser.add_argument("--json_out", default=None, help="also write every figure to this JSON file")
    parser.add_argument("--cache_dir", default="", help="token cache; default: next to the data")
    parser.add_argument("--seed", type=int, default=42)
    words = " ".join(parser.format_help().split())
    assert ("--steps STEPS timed optimizer steps (default: 10) --matmul_size MATMUL_SIZE side of the square matmul "
            "(default: 2048 on CPU, 8192 on a GPU) --json_out JSON_OUT also write every figure to this JSON file "
            "--cache_dir CACHE_DIR token cache; default: next to the data --seed SEED") in words


def test_a_help_that_uses_the_word_default_for_something_else_still_shows_the_flags_default():
    parser = ArgumentParser(prog="bench.py")
    parser.add_argument("--use_moe", type=int, choices=(0, 1), default=0,
                        help="1 = the trainer's MoE MLPs (its default experts and top-k)")
    parser.add_argument("--top", type=int, default=None, help="with --bytes: the ops shown one by one (default 15)")
    parser.add_argument("--out-dir", default="dataset/demo", help="where the files go: by default the repository's")
    words = " ".join(parser.format_help().split())
    assert ("--use_moe {0,1} 1 = the trainer's MoE MLPs (its default experts and top-k) (default: 0) --top TOP with "
            "--bytes: the ops shown one by one (default 15) --out-dir OUT_DIR where the files go: by default the "
            "repository's") in words


SCRIPTS_WITH_MAIN = ("bench", "bench_memory", "bench_prep", "bench_save", "bench_scaling", "chat", "eval_sft",
                     "export_hf", "inspect_data", "make_demo_data", "plot_loss", "profile_step", "step_figures",
                     "train_tokenizer", "verify_equivalence")


def test_every_script_s_help_shows_its_defaults_as_a_reader_types_them(capsys):
    """No `(default: None)` and no Python list (`['dataset/demo/sft_train.jsonl']`) in any --help."""
    for name in SCRIPTS_WITH_MAIN:
        with pytest.raises(SystemExit) as done:
            importlib.import_module(f"scripts.{name}").main(["--help"])
        words = " ".join(capsys.readouterr().out.split())
        assert done.value.code == 0 and words.startswith("usage:"), name
        assert "(default: None)" not in words and "(default: [" not in words, name
        if name == "train_tokenizer":
            assert "(default: dataset/demo/sft_train.jsonl)" in words
