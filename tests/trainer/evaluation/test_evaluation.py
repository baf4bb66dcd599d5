"""Evaluation during training: token accuracy, generation subset, several held-out files, ranks
sharing the work, the best model in best/ and early stopping (trainer/evaluation/evaluate.py,
trainer/evaluation/selection.py)."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cache_checks import held_out_entry
from tests.helpers.trainer_launch import (
    checkpoint_at, eval_rows, flags, run_trainer, run_trainer_in_process, together,
)
from trainer.evaluation.evaluate import last_assistant_turn, loss_and_accuracy_sums
from trainer.evaluation.selection import improves, metric_mode, update_selection

IGNORE = -100


def tiny_model(seed=0):
    from model import MiniMindConfig, MiniMindForCausalLM

    torch.manual_seed(seed)
    config = MiniMindConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    return MiniMindForCausalLM(config).eval()


def test_token_accuracy_and_loss_are_exact_on_a_hand_built_batch():
    model = tiny_model()
    input_ids = torch.randint(1, 64, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits[:, :-1]
    predicted = logits.argmax(-1)  # the prediction for the token at position t + 1
    # 14 loss tokens; the labels do not change the forward, so 6 of them are set to the model's
    # own prediction (right) and the other 8 to anything else (wrong).
    labels = torch.full_like(input_ids, IGNORE)
    right = [(0, 4), (0, 6), (1, 1), (1, 2), (1, 9), (2, 7)]
    wrong = [(0, 5), (0, 7), (0, 8), (1, 3), (1, 4), (1, 5), (1, 6), (1, 7)]
    for row, col in right:
        labels[row, col] = predicted[row, col - 1]
    for row, col in wrong:
        labels[row, col] = (predicted[row, col - 1] + 1) % 64
    targets = labels[:, 1:]
    keep = targets != IGNORE
    expected_loss = torch.nn.functional.cross_entropy(logits[keep].double(), targets[keep], reduction="sum")
    with torch.no_grad():
        sums = loss_and_accuracy_sums(model, [{"input_ids": input_ids, "labels": labels}], torch.device("cpu"),
                                      torch.float32)
    assert sums[1].item() == 14 and sums[2].item() == 6
    assert sums[0].item() == pytest.approx(expected_loss.item(), rel=1e-6)


def test_last_assistant_turn_is_the_prompt_split_and_a_truncated_turn_is_skipped():
    eos = 9
    ids = np.array([1, 2, 3, 4, 9, 5, 6, 7, 8, 9])
    labels = np.full(10, IGNORE)
    labels[3:5] = ids[3:5]   # first answer "4 <eos>"
    labels[7:10] = ids[7:10]  # last answer "7 8 <eos>"
    assert last_assistant_turn(ids, labels, eos) == (7, 10)
    cut = labels.copy()
    cut[9] = IGNORE  # truncated: the last turn does not end with eos
    assert last_assistant_turn(ids[:9], cut[:9], eos) is None
    assert last_assistant_turn(ids, np.full(10, IGNORE), eos) is None


def test_selection_directions_and_early_stop_at_the_right_evaluation():
    assert metric_mode("eval_loss") == "min" and metric_mode("eval_loss/tools") == "min"
    assert metric_mode("eval_token_accuracy") == "max" and metric_mode("eval_exact_match/a") == "max"
    assert improves(1.0, None, "min") and not improves(float("nan"), None, "min") and not improves(None, 1.0, "max")
    state = SimpleNamespace(step=0, best_value=None, best_step=None, evals_without_improvement=0)
    outcomes = []
    for step, value in enumerate([3.0, 2.0, 2.0, 2.5, 1.5, 1.6, 1.5, 1.7], start=1):
        state.step = step
        outcomes.append(update_selection(state, "eval_loss", {"eval_loss": value}, patience=3, data=[f"key{step}"]))
    assert [new for new, _ in outcomes] == [True, True, False, False, True, False, False, False]
    assert [stop for _, stop in outcomes] == [False] * 7 + [True]  # 3rd evaluation in a row without improvement
    assert (state.best_value, state.best_step, state.best_measured_on) == (1.5, 5, ["key5"])


def test_best_dir_holds_the_weights_of_the_best_step_and_metrics_record_it(data, tmp_path):
    (tmp_path / "b.jsonl").write_text("".join(open(data / "train.jsonl", encoding="utf-8").readlines()[:6]))
    eval_paths = f"{data / 'eval.jsonl'},{tmp_path / 'b.jsonl'}"
    run_trainer_in_process(flags(data, tmp_path / "run", "--batch_size", "8", "--max_steps", "6", "--eval_interval",
                                 "1", "--save_interval", "1", "--keep_last", "10", "--save_dtype", "float32",
                                 "--learning_rate", "2e-2", "--eval_data_path", eval_paths, "--keep_best",
                                 "eval_token_accuracy/b", "--eval_generate_samples", "3", "--eval_max_new_tokens", "4"),
                           check=True)
    evals, _ = eval_rows(tmp_path / "run")
    assert [row["step"] for row in evals] == [1, 2, 3, 4, 5, 6]
    for row in evals:
        assert {"eval_loss", "eval_token_accuracy", "eval_exact_match", "eval_loss/eval", "eval_loss/b",
                "eval_token_accuracy/b", "eval_exact_match/b"} <= row.keys()
        weighted = sum(row[f"eval_loss/{n}"] * row[f"eval_loss_tokens/{n}"] for n in ("eval", "b"))
        assert row["eval_loss_tokens"] == row["eval_loss_tokens/eval"] + row["eval_loss_tokens/b"]
        assert row["eval_loss"] == pytest.approx(weighted / row["eval_loss_tokens"], rel=1e-12)
    values = [row["eval_token_accuracy/b"] for row in evals]
    best_step = evals[values.index(max(values))]["step"]  # the first step reaching the maximum
    assert evals[-1]["best_step"] == best_step and evals[-1]["best_value"] == max(values)
    assert [row["new_best"] for row in evals] == [v > max(values[:i], default=-1) for i, v in enumerate(values)]
    record = json.loads((tmp_path / "run" / "best" / "best.json").read_text())
    assert record == {"metric": "eval_token_accuracy/b", "mode": "max", "value": max(values), "step": best_step,
                      "measured_on": [held_out_entry(tmp_path / "b.jsonl", 6)]}  # of eval_token_accuracy/b alone
    best = load_file(str(tmp_path / "run" / "best" / "model.safetensors"))
    saved = torch.load(checkpoint_at(tmp_path / "run", best_step), weights_only=True)["model"]
    other = torch.load(checkpoint_at(tmp_path / "run", 6 if best_step != 6 else 5), weights_only=True)["model"]
    names = [name for name in saved if name in best]
    assert len(names) > 5
    assert all(torch.equal(best[name], saved[name]) for name in names)
    assert not all(torch.equal(best[name], other[name]) for name in names)


@pytest.mark.slow
def test_early_stop_stops_every_rank_at_the_right_evaluation_and_saves(data, tmp_path):
    # A learning rate this small leaves the argmax predictions unchanged: the token accuracy never
    # improves after the first evaluation, so patience 2 stops after the 3rd evaluation (step 6).
    run = run_trainer(flags(data, tmp_path / "run", "--batch_size", "4", "--max_steps", "20", "--eval_interval", "2",
                            "--save_interval", "0", "--learning_rate", "1e-9", "--eval_data_path",
                            str(data / "eval.jsonl"), "--keep_best", "eval_token_accuracy",
                            "--early_stop_patience", "2"), nproc=2)
    evals, rows = eval_rows(tmp_path / "run")
    values = [row["eval_token_accuracy"] for row in evals]
    assert [row["step"] for row in evals] == [2, 4, 6] and len(set(values)) == 1
    assert rows[-1]["kind"] == "early_stop" and rows[-1]["step"] == 6 and rows[-1]["best_step"] == 2
    assert "stopped early" in run.stdout
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["step_00000006.pt"]
    assert json.loads((tmp_path / "run" / "best" / "best.json").read_text())["step"] == 2


def test_keep_best_of_a_metric_the_run_does_not_report_is_a_one_line_error(data, tmp_path, capsys):
    import signal

    from train_full_sft import main

    # Only the data can tell: none of the first 3 held-out conversations calls a tool.
    plain = [line for line in open(data / "train.jsonl", encoding="utf-8") if '"tool_calls"' not in line][:3]
    (tmp_path / "plain.jsonl").write_text("".join(plain), encoding="utf-8")
    handler = signal.getsignal(signal.SIGTERM)
    assert main(flags(data, tmp_path / "run", "--max_steps", "1", "--eval_data_path", str(tmp_path / "plain.jsonl"),
                      "--eval_generate_samples", "3", "--keep_best", "eval_tool_call_accuracy")) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --keep_best eval_tool_call_accuracy: this run reports no such metric "
        "(it reports: eval_loss, eval_token_accuracy, eval_exact_match)")
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
    signal.signal(signal.SIGTERM, handler)  # main() stopped before uninstalling its preemption handler


@pytest.mark.parametrize("extra, message", [
    (["--keep_best", "eval_loss"], "--keep_best eval_loss needs held-out data: give --eval_data_path"),
    (["--early_stop_patience", "2"], "--early_stop_patience needs --keep_best METRIC (the metric that must improve)"),
    (["--eval_data_path", "EVAL", "--keep_best", "eval_loss", "--early_stop_patience", "2"],
     "--early_stop_patience 2 needs --eval_interval N: with 0 the only evaluation is the one at the end"),
    (["--eval_data_path", "EVAL", "--keep_best", "eval_los"],
     "--keep_best eval_los: unknown metric (use eval_loss, eval_token_accuracy, eval_exact_match, "
     "eval_tool_call_accuracy, or KEY/NAME for one held-out file)"),
    (["--eval_data_path", "EVAL", "--keep_best", "eval_exact_match"],
     "--keep_best eval_exact_match needs --eval_generate_samples N (answers are generated only then)"),
    (["--eval_data_path", "EVAL", "--keep_best", "eval_loss/eval"],
     "--keep_best eval_loss/eval: no held-out file named 'eval' (a single held-out file has no per-file keys)"),
    (["--eval_data_path", "EVAL,TRAIN", "--keep_best", "eval_loss/tools"],
     "--keep_best eval_loss/tools: no held-out file named 'tools' (the held-out files are named eval, train)"),
])
def test_selection_flags_that_cannot_work_fail_before_the_data_is_read(data, tmp_path, capsys, extra, message):
    """--keep_best / --early_stop_patience combinations the flags alone rule out are refused by
    parse_args: one line, exit 2, before any token cache is built or the save dir is touched."""
    import signal

    from train_full_sft import main

    extra = [part.replace("EVAL", str(data / "eval.jsonl")).replace("TRAIN", str(data / "train.jsonl"))
             for part in extra]
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stopped:
            main(flags(data, tmp_path / "run", "--max_steps", "1", "--cache_dir", str(tmp_path / "cache"), *extra))
    finally:
        signal.signal(signal.SIGTERM, handler)  # main() stopped before uninstalling its preemption handler
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")
    assert not os.path.exists(tmp_path / "cache") and not os.path.exists(tmp_path / "run")


# --------------------------------------------------------------------------- ranks share the work


@pytest.mark.slow
def test_fsdp_evaluation_with_uneven_slices_equals_one_process_and_keeps_the_best(data, tmp_path):
    # 15 held-out samples, batch 1: rank 0 runs 8 forwards, rank 1 only has 7 and pads one (under
    # FSDP every forward is a collective; without the padding forward this run hangs).
    common = ["--batch_size", "1", "--max_steps", "2", "--eval_interval", "2", "--save_interval", "0",
              "--eval_data_path", str(data / "eval.jsonl"), "--dist_timeout", "60"]
    together(lambda: run_trainer_in_process(flags(data, tmp_path / "one", *common[2:], "--batch_size", "2",
                                                  "--max_steps", "2"), check=True),
             lambda: run_trainer(flags(data, tmp_path / "fsdp", *common, "--fsdp", "1", "--keep_best", "eval_loss"),
                                 nproc=2))
    (fsdp,), (one,) = eval_rows(tmp_path / "fsdp")[0], eval_rows(tmp_path / "one")[0]
    assert fsdp["eval_loss_tokens"] == one["eval_loss_tokens"]
    assert fsdp["eval_token_accuracy"] == one["eval_token_accuracy"]
    assert fsdp["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    assert json.loads((tmp_path / "fsdp" / "best" / "best.json").read_text())["step"] == 2


def test_generation_with_fsdp_is_refused_with_one_line(capsys):
    from trainer.args import parse_args

    with pytest.raises(SystemExit) as stopped:
        parse_args(["--fsdp", "1", "--eval_generate_samples", "4"])
    assert stopped.value.code == 2 and "--eval_generate_samples needs whole weights" in capsys.readouterr().err


def _evaluate_in_process(rank, world_size, init_file, data_path, out_dir):
    from dataset import load_tokenizer
    from trainer.data_setup import build_eval_sets
    from trainer.evaluation.evaluate import evaluate

    if world_size > 1:
        torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                             world_size=world_size)
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(None)
    args = SimpleNamespace(eval_data_path=data_path, max_seq_len=128, bad_data="error", cache_dir=out_dir,
                           packing=0, batch_size=3, eval_generate_samples=5, eval_max_new_tokens=4)
    ctx = SimpleNamespace(rank=rank, local_rank=rank, world_size=world_size, device=torch.device("cpu"))
    eval_sets = build_eval_sets(args, tokenizer, ctx, 1024)
    model = tiny_model_for(tokenizer)
    run = SimpleNamespace(raw_model=model, ctx=ctx, dtype=torch.float32, args=args, tokenizer=tokenizer,
                          eval_sets=eval_sets)
    result = evaluate(run)
    assert model.training  # train mode restored
    if rank == 0:
        with open(os.path.join(out_dir, f"result_{world_size}.json"), "w", encoding="utf-8") as handle:
            json.dump({"figures": result, "examples": [len(s.examples) for s in eval_sets]}, handle)
    if world_size > 1:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_process_evaluation_equals_one_process(data, tmp_path):
    import torch.multiprocessing as mp

    paths = f"{data / 'eval.jsonl'},{data / 'train.jsonl'}"
    _evaluate_in_process(0, 1, None, paths, str(tmp_path))
    mp.spawn(_evaluate_in_process, args=(2, str(tmp_path / "init"), paths, str(tmp_path)), nprocs=2)
    one = json.loads((tmp_path / "result_1.json").read_text())
    two = json.loads((tmp_path / "result_2.json").read_text())
    assert one["examples"] == [5, 5] and two["examples"] == [3, 3]  # rank 0's share of 5 prompts
    assert one["figures"].keys() == two["figures"].keys()
    assert "eval_exact_match/train" in one["figures"]
    for key, value in one["figures"].items():  # counts exact; losses up to float32 summation order
        assert two["figures"][key] == (pytest.approx(value, rel=1e-6) if "eval_loss/" in key + "/" else value), key


def test_a_resumed_run_keeps_comparing_against_the_best_of_the_run_before(data, tmp_path):
    common = ["--batch_size", "8", "--max_steps", "6", "--eval_interval", "1", "--eval_data_path",
              str(data / "eval.jsonl"), "--keep_best", "eval_loss", "--learning_rate", "3e-2", "--warmup_steps", "0"]
    run_trainer_in_process(flags(data, tmp_path / "run", *common, "--save_interval", "3"), check=True)
    full, _ = eval_rows(tmp_path / "run")
    old_best = (tmp_path / "run" / "best" / "best.json").read_text()
    assert json.loads(old_best)["step"] > 3  # the loss falls fast: the best is after the step resumed below
    # A rollback to step 3 in the same directory: a new line of training with the best of step 3's state.
    run_trainer_in_process(flags(data, tmp_path / "run", *common, "--save_interval", "0",
                                 "--resume_from", checkpoint_at(tmp_path / "run", 3)), check=True)
    resumed = eval_rows(tmp_path / "run")[0][len(full):]
    fields = ("step", "eval_loss", "best_value", "best_step", "new_best")
    assert [[row[k] for k in fields] for row in resumed] == [[row[k] for k in fields] for row in full[3:]]
    saved = torch.load(checkpoint_at(tmp_path / "run", 3), weights_only=True)
    assert (saved["best_value"], saved["best_step"]) == (full[2]["best_value"], full[2]["best_step"])
    assert saved["evals_without_improvement"] == 3 - full[2]["best_step"]
    # the old line's best/ was moved aside with its later checkpoint, and the new line wrote its own
    aside = [os.path.join(root, "best.json") for root, _, files in os.walk(tmp_path / "run" / "set_aside")
             if "best.json" in files]
    assert len(aside) == 1 and open(aside[0], encoding="utf-8").read() == old_best
    assert json.loads((tmp_path / "run" / "best" / "best.json").read_text())["step"] == resumed[-1]["best_step"]


def test_a_resume_with_another_keep_best_metric_starts_the_selection_afresh(data, tmp_path):
    run = tmp_path / "run"
    common = ["--batch_size", "8", "--eval_interval", "1", "--eval_data_path", str(data / "eval.jsonl")]
    run_trainer_in_process(flags(data, run, *common, "--max_steps", "2", "--keep_best", "eval_loss"), check=True)
    old_best = json.loads((run / "best" / "best.json").read_text())
    # Token accuracy (about 0.1) compared with the best eval loss (about 8) would never "improve":
    # patience 1 stopped the run at its first evaluation, and best/ kept the eval_loss model.
    resumed = run_trainer_in_process(flags(data, run, *common, "--max_steps", "4", "--from_resume", "1",
                                           "--keep_best", "eval_token_accuracy", "--early_stop_patience", "1"),
                                     check=True)
    evals, _ = eval_rows(run)
    after = [row for row in evals if row["step"] > 2]
    assert after[0]["step"] == 3 and after[0]["new_best"] and after[0]["best_metric"] == "eval_token_accuracy"
    assert after[0]["best_value"] == after[0]["eval_token_accuracy"] and after[0]["best_step"] == 3
    assert [row["step"] for row in after] == [3, 4]  # went on past its first evaluation
    assert "stopped early" not in resumed.stdout  # patience 1 counted from step 3; step 4 is the run's last
    notes = [line for line in resumed.stdout.splitlines() if line.startswith("--keep_best")]
    assert len(notes) == 1 and notes[0].startswith(
        f"--keep_best eval_token_accuracy: the checkpoint's best is of eval_loss ({old_best['value']:.4f} at step "
        f"{old_best['step']}), which eval_token_accuracy cannot be compared with: the selection starts afresh; "
        f"its best/ (of eval_loss) moved to {run / 'set_aside'}")
    record = json.loads((run / "best" / "best.json").read_text())
    assert record["metric"] == "eval_token_accuracy" and record["step"] >= 3
    aside = [os.path.join(root, "best.json") for root, _, files in os.walk(run / "set_aside") if "best.json" in files]
    assert len(aside) == 1 and json.loads(open(aside[0], encoding="utf-8").read()) == old_best
    assert torch.load(checkpoint_at(run, 2), weights_only=True)["best_metric"] == "eval_loss"
    assert torch.load(checkpoint_at(run, 4), weights_only=True)["best_metric"] == "eval_token_accuracy"


# --------------------------------------------------------------------------- end of turn


def test_a_tokenizer_whose_eos_is_not_the_end_of_turn_token_keeps_its_generation_prompts(data, tmp_path, capsys):
    """A Qwen-base-like tokenizer: eos <|endoftext|>, while the template closes turns with <|im_end|>.
    The prompts are still found, generation stops at either token, and the exported generation
    config stops at both."""
    from dataset import load_tokenizer
    from trainer.data_setup import build_eval_sets

    shipped = load_tokenizer(None)
    shipped.eos_token = "<|endoftext|>"
    shipped.save_pretrained(str(tmp_path / "tok"))
    tokenizer = load_tokenizer(tmp_path / "tok")
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tokenizer.eos_token_id == endoftext != im_end

    args = SimpleNamespace(eval_data_path=str(data / "eval.jsonl"), max_seq_len=2048, bad_data="error",
                           cache_dir=str(tmp_path / "cache"), packing=0, batch_size=4, eval_generate_samples=5,
                           eval_max_new_tokens=4)
    ctx = SimpleNamespace(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    (eval_set,) = build_eval_sets(args, tokenizer, ctx, 2048)
    assert len(eval_set.examples) == 5  # was 0: the turns end with <|im_end|>, not with eos
    assert "generation prompts" not in capsys.readouterr().out
    args.eval_generate_samples = 40  # more than the file holds: one line says so
    (eval_set,) = build_eval_sets(args, tokenizer, ctx, 2048)
    assert capsys.readouterr().out.splitlines() == [
        "[eval] eval: 16 generation prompts of the 40 asked for (--eval_generate_samples): the file has only 16 "
        "conversations"]

    from trainer.evaluation.evaluate import end_of_turn_token_id, greedy_generate, stop_token_ids

    assert end_of_turn_token_id(tokenizer) == im_end and stop_token_ids(tokenizer) == [im_end, endoftext]
    assert stop_token_ids(load_tokenizer(None)) == [im_end]
    # Generation stops at whichever stop token comes first.
    seen = {}

    def generate(input_ids, **settings):
        seen.update(settings)
        return torch.cat([input_ids, torch.tensor([[7, endoftext, 8, im_end], [7, 8, im_end, endoftext]])], dim=1)

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64), generate=generate,
                            parameters=lambda: iter([torch.zeros(1)]))
    assert greedy_generate(model, [[1, 5], [1, 6]], 0, stop_token_ids(tokenizer), 2, 4) == [[7], [7, 8]]
    assert seen["eos_token_id"] == [im_end, endoftext]

    # In a run: the held-out answers are generated and judged, and model/ stops at both tokens.
    run = tmp_path / "run"
    run_trainer_in_process(flags(data, run, "--batch_size", "8", "--max_steps", "1", "--tokenizer_path",
                                 str(tmp_path / "tok"), "--eval_data_path", str(data / "eval.jsonl"),
                                 "--eval_generate_samples", "2", "--eval_max_new_tokens", "2"), check=True)
    evals, _ = eval_rows(run)
    assert "eval_exact_match" in evals[-1] or "eval_tool_call_accuracy" in evals[-1]
    assert json.loads((run / "model" / "generation_config.json").read_text())["eos_token_id"] == [im_end, endoftext]


# --------------------------------------------------------------------------- tool calls

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}


def call_text(name, arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_an_answer_is_right_by_its_calls_or_by_its_reply():
    from trainer.evaluation.evaluate import answer_is_right

    think = "<think>\nthe user wants the weather\n</think>\n\n"
    assert answer_is_right(think + call_text("get_weather", {"days": 2.0, "city": "Paris"}), "", [WEATHER])
    assert not answer_is_right(call_text("get_weather", {"city": "Rome", "days": 2}), "", [WEATHER])
    assert not answer_is_right(call_text("get_time", WEATHER["arguments"]), "", [WEATHER])
    assert not answer_is_right("It is sunny in Paris.", "", [WEATHER])
    assert not answer_is_right(call_text("get_weather", WEATHER["arguments"]) + "\n<tool_call>\n{oops\n</tool_call>",
                               "", [WEATHER])
    assert answer_is_right(think + "  Paris.\n", "Paris.", [])
    assert not answer_is_right("Paris.\n" + call_text("get_weather", WEATHER["arguments"]), "Paris.", [])
    assert not answer_is_right("Lyon.", "Paris.", [])


def test_tool_call_accuracy_and_exact_match_are_counted_per_kind_of_turn(tmp_path, monkeypatch):
    """The held-out references come out of the token cache with their calls; answers that make
    the right calls / say the right reply count, the others do not."""
    import trainer.evaluation.evaluate as evaluation
    from dataset import load_tokenizer
    from trainer.data_setup import build_eval_sets

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                                "parameters": {"type": "object", "properties": {}}}}]
    rows = []
    for city in ("Paris", "Rome", "Oslo"):
        call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city, "days": 2}}}
        rows.append({"messages": [{"role": "user", "content": f"Weather in {city}?"},
                                  {"role": "assistant", "content": "", "tool_calls": [call]}], "tools": tools})
    for city in ("Lumbria", "Vessa"):
        rows.append({"messages": [{"role": "user", "content": f"Capital of {city}?"},
                                  {"role": "assistant", "content": f"The capital is {city}ton."}]})
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    tokenizer = load_tokenizer(None)
    args = SimpleNamespace(eval_data_path=str(tmp_path / "mixed.jsonl"), max_seq_len=512, bad_data="error",
                           cache_dir=str(tmp_path), packing=0, batch_size=2, eval_generate_samples=10,
                           eval_max_new_tokens=4)
    ctx = SimpleNamespace(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    (eval_set,) = build_eval_sets(args, tokenizer, ctx, 1024)
    assert (eval_set.num_replies, eval_set.num_tool_turns) == (2, 3)
    assert [e.reference_calls for e in eval_set.examples[:3]] == [
        [{"name": "get_weather", "arguments": {"city": city, "days": 2}}] for city in ("Paris", "Rome", "Oslo")]
    assert [e.reference for e in eval_set.examples[3:]] == ["The capital is Lumbriaton.", "The capital is Vessaton."]
    # A stand-in for the model's answers: right calls for Paris and Oslo, a wrong city for Rome,
    # the right reply for Lumbria, a tool call instead of the reply for Vessa.
    answers = [call_text("get_weather", {"city": "Paris", "days": 2}), call_text("get_weather", {"city": "Roma", "days": 2}),
               call_text("get_weather", {"city": "Oslo", "days": 2}), "The capital is Lumbriaton.",
               call_text("get_weather", {"city": "Vessa"})]
    by_prompt = {tuple(e.prompt_ids): tokenizer.encode(a, add_special_tokens=False)
                 for e, a in zip(eval_set.examples, answers)}
    monkeypatch.setattr(evaluation, "greedy_generate", lambda model, prompts, *rest: [by_prompt[tuple(p)] for p in prompts])
    run = SimpleNamespace(raw_model=tiny_model_for(tokenizer), ctx=ctx, dtype=torch.float32, args=args,
                          tokenizer=tokenizer, eval_sets=[eval_set])
    figures = evaluation.evaluate(run)
    assert figures["eval_tool_call_accuracy"] == 2 / 3 and figures["eval_exact_match"] == 1 / 2
    assert evaluation.metric_names([eval_set]) == ["eval_loss", "eval_token_accuracy", "eval_exact_match",
                                                   "eval_tool_call_accuracy"]


def tiny_model_for(tokenizer):
    from model import MiniMindConfig, MiniMindForCausalLM

    torch.manual_seed(0)
    return MiniMindForCausalLM(MiniMindConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                              num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                              max_position_embeddings=1024))
