"""The generation prompts of the held-out files against the model's context: those that do not fit
with --eval_max_new_tokens are counted in one line at start (rank 0), and no room at all is refused;
generation runs compiled blocks eagerly."""

import pytest
import torch

from tests.helpers.trainer_launch import eval_rows, run_trainer, run_trainer_in_process


def small_context_run(data, trained, save_dir, *extra) -> list[str]:
    """Trainer flags from the overfitted model (a context of 512 positions) with two generation prompts."""
    return ["--from_weight", str(trained["hf_dir"]), "--data_path", str(data / "train.jsonl"), "--save_dir",
            str(save_dir), "--max_seq_len", "512", "--dtype", "float32", "--batch_size", "8",
            "--eval_data_path", str(data / "eval.jsonl"), "--eval_generate_samples", "2", *extra]


WARNING = ("[eval] warning: eval: 2 of 2 prompts are longer than the model's context (512) minus "
           "--eval_max_new_tokens (500): answered from their last 12 tokens (lower --eval_max_new_tokens)")


def test_prompts_cut_to_fit_the_context_are_said_once_at_start(data, trained, tmp_path):
    # the prompts are fixed at start: counted there, not at every evaluation
    run = small_context_run(data, trained, tmp_path / "run", "--max_steps", "2", "--eval_interval", "1",
                            "--eval_max_new_tokens", "500")
    done = run_trainer_in_process(run, check=True)
    assert [line for line in done.stdout.splitlines() if "[eval] warning" in line] == [WARNING]
    assert len(eval_rows(tmp_path / "run")[0]) >= 2
    fits = run_trainer_in_process(small_context_run(data, trained, tmp_path / "fits", "--max_steps", "1",
                                                    "--eval_max_new_tokens", "8"), check=True)
    assert "[eval] warning" not in fits.stdout


def test_an_eval_max_new_tokens_that_leaves_no_room_is_refused_before_training(data, trained, tmp_path):
    # else the first evaluation would end the run in a traceback
    done = run_trainer_in_process(small_context_run(data, trained, tmp_path / "run", "--max_steps", "2",
                                                    "--eval_max_new_tokens", "512"))
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == ("error: --eval_max_new_tokens 512 leaves no room for a prompt in the "
                                            "model's context of 512 tokens")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_without_generation_eval_max_new_tokens_is_not_measured_against_the_context(data, tmp_path):
    from types import SimpleNamespace

    import torch

    from dataset import load_tokenizer
    from trainer.data_setup import build_eval_sets

    args = SimpleNamespace(eval_data_path=str(data / "eval.jsonl"), max_seq_len=512, bad_data="error",
                           cache_dir=str(tmp_path), packing=0, batch_size=4, eval_generate_samples=0,
                           eval_max_new_tokens=600)
    ctx = SimpleNamespace(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    (eval_set,) = build_eval_sets(args, load_tokenizer(None), ctx, 512)
    assert (len(eval_set.loader.dataset), eval_set.examples) == (16, [])


def test_the_no_room_line_names_the_flag_and_generation_without_room_is_a_value_error():
    from trainer.evaluation.evaluate import no_room_problem, prompt_room

    assert (no_room_problem(8, 7, "--x"), prompt_room(8, 7)) == (None, 1)
    assert no_room_problem(8, 9, "--x") == "--x 9 leaves no room for a prompt in the model's context of 8 tokens"
    with pytest.raises(ValueError) as refused:
        prompt_room(8, 8)
    assert str(refused.value) == "max_new_tokens 8 leaves no room for a prompt in the model's context of 8 tokens"


def test_fewer_new_tokens_are_advised_only_where_they_would_let_a_prompt_fit():
    from trainer.evaluation.evaluate import long_prompts

    head = "prompts are longer than the model's context (8) minus --x (2): answered from their last 6 tokens"
    assert long_prompts([[0] * 8, [0] * 3, [0] * 9], 8, 2, "--x") == f"2 of 3 {head}"  # no room for either
    assert long_prompts([[0] * 7, [0] * 8], 8, 2, "--x") == f"2 of 2 {head} (lower --x)"
    assert long_prompts([[0] * 6, []], 8, 2, "--x") is None


@pytest.mark.slow
def test_under_ddp_rank_0_alone_says_how_many_prompts_are_cut(data, trained, tmp_path):
    done = run_trainer(small_context_run(data, trained, tmp_path / "run", "--max_steps", "1",
                                         "--eval_max_new_tokens", "500"), nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line for line in done.stdout.splitlines() if "[eval] warning" in line] == [WARNING]


def test_generation_runs_compiled_blocks_eagerly_and_compiles_nothing():
    """--use_compile 1 with --eval_generate_samples: the KV-cache forward would compile a block
    again for every layer (its guards read that layer's cache), filling the recompile limit that
    the training graphs share. Generation runs the blocks eagerly: nothing is compiled, and the
    answers are those of the uncompiled model."""
    from torch._dynamo.testing import CompileCounter

    from model import MiniMindConfig, MiniMindForCausalLM
    from trainer.evaluation.evaluate import greedy_generate
    from trainer.model_setup import compile_model

    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3,
                                               num_attention_heads=4, num_key_value_heads=2)).eval()
    expected = greedy_generate(model, [[1, 5, 9], [1, 6]], 0, [2], 2, 5)
    torch._dynamo.reset()
    counter = CompileCounter()
    compile_model(model, torch.device("cpu"), backend=counter)
    assert greedy_generate(model, [[1, 5, 9], [1, 6]], 0, [2], 2, 5) == expected
    assert counter.frame_count == 0


def test_a_conversation_whose_later_turns_max_seq_len_cut_gives_no_prompt_of_an_earlier_turn(tmp_path, capsys):
    """--max_seq_len cuts the second question of a two-question conversation: its first answer is
    whole in the sample, but it is not the conversation's last turn (which eval_sft.py judges, and
    which decides whether a turn counts for exact match or tool-call accuracy): skipped, said in the
    line, as a last turn cut in its middle is. The conversation that fits gives its last turn."""
    import json
    from types import SimpleNamespace

    from dataset import load_tokenizer
    from trainer.data_setup import build_eval_sets

    tokenizer = load_tokenizer(None)
    two = [{"role": "user", "content": "Capital of Lumbria?"}, {"role": "assistant", "content": "Velm"},
           {"role": "user", "content": "And its flag colour? " + "Please answer in one word. " * 8},
           {"role": "assistant", "content": "blue"}]
    one = [{"role": "user", "content": "Sum of 2 and 3?"}, {"role": "assistant", "content": "5"}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"conversations": c}) + "\n" for c in (two, one)),
                                         encoding="utf-8")
    args = SimpleNamespace(eval_data_path=str(tmp_path / "eval.jsonl"), max_seq_len=48, bad_data="error",
                           cache_dir=str(tmp_path / "cache"), packing=0, batch_size=2, eval_generate_samples=2,
                           eval_max_new_tokens=4)
    ctx = SimpleNamespace(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    (eval_set,) = build_eval_sets(args, tokenizer, ctx, 512)
    assert len(eval_set.loader.dataset) == 2  # both are samples: the loss counts the first answer
    assert [(e.reference, e.reference_calls) for e in eval_set.examples] == [("5", [])]
    assert capsys.readouterr().out.splitlines()[-1] == (
        "[eval] eval: 1 generation prompts of the 2 asked for (--eval_generate_samples): only 1 of its 2 "
        "conversations end with a whole assistant turn within --max_seq_len (the others reach it: it may have cut "
        "them)")
