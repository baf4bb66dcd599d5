"""scripts/eval_sft.py: exact match and loss computed by hand, per-task counts, every data format, batched greedy."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from dataset import encode_conversation
from tests.helpers.overfitted import CONVERSATIONS, script, script_in_process


def hand_loss(model, tokenizer) -> tuple[float, int]:
    """Mean CE over assistant tokens, one conversation at a time, without padding (fp32 CE, like the model)."""
    total, count = 0.0, 0
    for messages in CONVERSATIONS:
        ids, mask = encode_conversation(tokenizer, messages, 512)
        with torch.no_grad():
            logits = model(torch.tensor(ids)[None]).logits[0]
        targets = torch.tensor(ids)[1:]
        losses = F.cross_entropy(logits[:-1], targets, reduction="none")
        keep = torch.tensor(mask)[1:]
        total += losses[keep].double().sum().item()
        count += int(keep.sum())
    return total / count, count


def test_eval_reports_exact_match_and_hand_computed_loss(trained, tmp_path):
    out = tmp_path / "result.json"
    result = script("eval_sft.py", "--model_path", str(trained["checkpoint"]), "--data_path", str(trained["data"]),
                    "--batch_size", "2", "--json_out", str(out), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "exact match" in result.stdout
    report = json.loads(out.read_text())
    loss, count = hand_loss(trained["model"], trained["tokenizer"])
    assert report["exact_match"] == 1.0 and report["num_conversations"] == 3
    assert report["num_loss_tokens"] == count
    assert report["loss"] == pytest.approx(loss, rel=1e-5)
    assert report["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    # no tool-call turn to score: null, as JSON has no NaN (strict readers fail on it)
    assert report["tool_call_accuracy"] is None and "NaN" not in out.read_text()


def test_eval_counts_right_answers_per_task_where_rows_name_one(trained, tmp_path):
    wrong = [*CONVERSATIONS[1][:-1], {"role": "assistant", "content": "6"}]  # the model answers 5
    rows = [(CONVERSATIONS[0], "fact"), (CONVERSATIONS[1], "fact"), (wrong, "fact"), (CONVERSATIONS[2], "chat"),
            (CONVERSATIONS[0], None)]
    data = tmp_path / "tasks.jsonl"
    # the first line with a byte order mark, as some exported files have: read like the others
    data.write_text("\ufeff" + "".join(json.dumps({"conversations": c, **({"task": t} if t else {})}) + "\n"
                                       for c, t in rows), encoding="utf-8")
    out = tmp_path / "result.json"
    result = script_in_process("eval_sft.py", "--model_path", str(trained["run_dir"]), "--data_path", str(data),
                               "--json_out", str(out), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert (report["num_correct"], report["num_replies"]) == (4, 5)
    assert report["by_task"] == {"chat": {"right": 1, "total": 1}, "fact": {"right": 2, "total": 3}}
    assert result.stdout.splitlines()[-3:] == ["by task        right/total", "  chat         1/1", "  fact         2/3"]


def test_eval_reads_jsonl_gz_and_parquet_as_training_does(trained, tmp_path):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from scripts.eval_sft import evaluate, read_examples

    rows = [{"conversations": c, "task": t} for c, t in zip(CONVERSATIONS, ("fact", "sum", "fact"))]
    text = "".join(json.dumps(row) + "\n" for row in rows)
    (tmp_path / "e.jsonl").write_text(text, encoding="utf-8")
    (tmp_path / "e.jsonl.gz").write_bytes(gzip.compress(text.encode("utf-8")))
    pq.write_table(pa.Table.from_pylist([{**row, "id": i} for i, row in enumerate(rows)]), tmp_path / "e.parquet")
    model, tokenizer = trained["model"], trained["tokenizer"]
    examples = {name: read_examples(tmp_path / name, tokenizer, 512) for name in ("e.jsonl", "e.jsonl.gz", "e.parquet")}
    assert examples["e.jsonl.gz"] == examples["e.parquet"] == examples["e.jsonl"]
    assert [e.task for e in examples["e.parquet"]] == ["fact", "sum", "fact"]
    results = [evaluate(model, tokenizer, found, 2, 8) for found in examples.values()]
    assert results[0]["exact_match"] == 1.0 and results[0]["by_task"] == {"fact": {"right": 2, "total": 2},
                                                                          "sum": {"right": 1, "total": 1}}
    assert json.dumps(results[1]) == json.dumps(results[2]) == json.dumps(results[0])  # NaN tool-call accuracy
    result = script_in_process("eval_sft.py", "--model_path", str(trained["run_dir"]), "--data_path",
                               str(tmp_path / "e.parquet"), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["by_task"] == results[0]["by_task"]


def test_eval_table_escapes_control_characters_of_task_names():
    from scripts.eval_sft import format_table

    result = {"num_conversations": 1, "num_loss_tokens": 3, "loss": 0.5, "perplexity": 1.6487, "exact_match": 1.0,
              "num_correct": 1, "num_replies": 1, "num_tool_call_turns": 0,
              "by_task": {"x\ry\x1b[2J\x07": {"right": 1, "total": 1}}}
    assert format_table(result).splitlines()[-2:] == ["by task           right/total", "  x\\ry\\x1b[2J\\x07 1/1"]


def test_eval_table_of_a_file_without_reply_turns_has_no_exact_match_row_as_json_has_null():
    from scripts.eval_sft import format_table

    result = {"num_conversations": 1, "num_loss_tokens": 3, "loss": 0.5, "perplexity": 1.6487,
              "exact_match": float("nan"), "num_correct": 0, "num_replies": 0, "tool_call_accuracy": 1.0,
              "num_tool_calls_correct": 1, "num_tool_call_turns": 1, "by_task": {}}
    assert format_table(result).splitlines() == [
        "conversations  1", "loss tokens    3", "loss           0.5000", "perplexity     1.6487",
        "tool calls     1.0000 (1/1)"]


def test_batched_left_padded_greedy_equals_one_by_one(trained):
    from scripts.eval_sft import greedy_answers, read_examples

    model, tokenizer = trained["model"], trained["tokenizer"]
    examples = read_examples(trained["data"], tokenizer, 512)
    batched = greedy_answers(model, tokenizer, examples, batch_size=3, max_new_tokens=8)
    single = greedy_answers(model, tokenizer, examples, batch_size=1, max_new_tokens=8)
    assert batched == single == [c[-1]["content"] for c in CONVERSATIONS]


def test_conversations_whose_answers_max_seq_len_cuts_off_are_named_not_left_out_silently(trained, tmp_path):
    # --max_seq_len 20: the first conversation's answer starts at token 31, the others' before 20.
    out = tmp_path / "result.json"
    done = script_in_process("eval_sft.py", "--model_path", str(trained["checkpoint"]), "--data_path",
                             str(trained["data"]), "--max_seq_len", "20", "--json_out", str(out), "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["warning: 1 of 3 conversations keep no answer token within --max_seq_len 20: "
                                        "the loss counts the other 2 (raise --max_seq_len to count them)"]
    masks = [encode_conversation(trained["tokenizer"], messages, 20)[1] for messages in CONVERSATIONS]
    assert [int(mask[1:].sum()) for mask in masks] == [0, 4, 9]
    assert json.loads(out.read_text())["num_loss_tokens"] == 13


def test_a_json_out_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path):
    # the model path is never reached: the evaluation is not run only to fail at its end
    (tmp_path / "a_file").write_text("x")
    for value, line in ((tmp_path, f"--json_out {tmp_path} is a directory: give a file name"),
                        (tmp_path / "a_file" / "r.json",
                         f"--json_out {tmp_path / 'a_file' / 'r.json'}: {tmp_path / 'a_file'} is a file, not a folder")):
        done = script_in_process("eval_sft.py", "--model_path", str(tmp_path / "none"), "--json_out", str(value))
        assert (done.returncode, done.stderr) == (2, f"error: {line}\n")


def test_a_data_path_that_is_no_data_file_is_refused_before_the_model_loads(tmp_path):
    # the model path is never reached; a directory is named as this command's flag, not the trainer's
    (tmp_path / "empty.jsonl").write_text("")
    for value, line in ((tmp_path, f"--data_path {tmp_path} is a directory: eval_sft.py reads one .jsonl, "
                                   ".jsonl.gz, .json or .parquet file"),
                        (tmp_path / "empty.jsonl", f"{tmp_path / 'empty.jsonl'}: data file is empty"),
                        (tmp_path / "none.jsonl", f"{tmp_path / 'none.jsonl'}: data file not found")):
        done = script_in_process("eval_sft.py", "--model_path", str(tmp_path / "none"), "--data_path", str(value))
        assert (done.returncode, done.stderr) == (2, f"error: {line}\n")


def test_a_max_seq_len_that_holds_no_label_is_refused_before_the_model_loads(tmp_path):
    # one token has no next token to predict: the trainer's bound (>= 2), not a NaN loss with exit 0
    done = script_in_process("eval_sft.py", "--model_path", str(tmp_path / "none"), "--max_seq_len", "1")
    assert (done.returncode, done.stderr) == (2, "error: --max_seq_len must be >= 2 (got 1)\n")


@pytest.mark.parametrize("flags, line", [
    (["--batch_size", "0"], "--batch_size must be >= 1 (got 0)"),
    (["--max_new_tokens", "-3"], "--max_new_tokens must be >= 1 (got -3)"),
    (["--limit", "0"], "--limit must be >= 1 (got 0)"),
    (["--limit", "0", "--max_seq_len", "1", "--batch_size", "-1"],
     "--max_seq_len must be >= 2 (got 1); --batch_size must be >= 1 (got -1); --limit must be >= 1 (got 0)"),
])
def test_counts_out_of_range_are_refused_as_max_seq_len_is_before_the_model_loads(tmp_path, flags, line):
    # the trainer's bounds where it has the flag (--batch_size, --eval_max_new_tokens), one message form
    done = script_in_process("eval_sft.py", "--model_path", str(tmp_path / "none"), *flags)
    assert (done.returncode, done.stderr) == (2, f"error: {line}\n")


def test_a_set_without_a_loss_token_is_one_line_not_a_nan_loss(trained, tmp_path):
    # --max_seq_len 9: the earliest answer token of the three conversations is token 9 (of the third)
    masks = [encode_conversation(trained["tokenizer"], messages, 9)[1] for messages in CONVERSATIONS]
    assert [int(mask[1:].sum()) for mask in masks] == [0, 0, 0]
    out = tmp_path / "result.json"
    done = script_in_process("eval_sft.py", "--model_path", str(trained["checkpoint"]), "--data_path",
                             str(trained["data"]), "--max_seq_len", "9", "--json_out", str(out), "--device", "cpu")
    assert (done.returncode, done.stderr) == (
        2, f"error: {trained['data']}: no loss token to evaluate: --max_seq_len 9 cuts all 3 conversations before "
           "their first answer token (raise --max_seq_len)\n")
    assert not out.exists()
    # the model's context (512) is what cuts them: raising --max_seq_len cannot help, so it is not advised
    data = tmp_path / "long.jsonl"
    long = [{"role": "system", "content": "word " * 600}, *CONVERSATIONS[1]]
    data.write_text(json.dumps({"conversations": long}) + "\n", encoding="utf-8")
    done = script_in_process("eval_sft.py", "--model_path", str(trained["checkpoint"]), "--data_path", str(data),
                             "--device", "cpu")
    assert (done.returncode, done.stderr) == (
        2, f"error: {data}: no loss token to evaluate: the model's context of 512 tokens cuts the one conversation "
           "before its first answer token\n")


def test_the_loss_of_conversations_without_a_loss_token_is_an_error_from_python_too(trained):
    # the command refuses such a file before (above); a caller of the functions gets the error, not a NaN loss
    from dataset import DataError
    from scripts.eval_sft import assistant_loss, evaluate, read_examples

    model, tokenizer = trained["model"], trained["tokenizer"]
    examples = read_examples(trained["data"], tokenizer, 9)  # --max_seq_len 9 cuts every answer (above)
    for call, count in ((lambda: assistant_loss(model, examples, tokenizer.pad_token_id, 2), 3),
                        (lambda: evaluate(model, tokenizer, examples, 2, 8), 3),
                        (lambda: assistant_loss(model, [], tokenizer.pad_token_id, 2), 0)):
        with pytest.raises(DataError) as raised:
            call()
        assert str(raised.value) == (f"no loss token to evaluate: none of the {count} conversations given has an "
                                     "assistant token after its first token")


def test_the_loss_runs_on_the_trainers_inputs_and_reads_the_device_once(trained, monkeypatch):
    """The model gets what the trainer's evaluation gives it (`model_inputs`: no attention mask, so
    no dense [B,1,T,T] mask keeps SDPA off its fused causal kernel), and the batches' sums stay on
    the device until the last: one host read, not one per batch."""
    from scripts.eval_sft import assistant_loss, read_examples
    from scripts._host_reads import HostReads

    model, tokenizer = trained["model"], trained["tokenizer"]
    examples = read_examples(trained["data"], tokenizer, 512)
    given, forward = [], model.forward

    def spy(*args, **kwargs):
        given.append(sorted(kwargs))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    with HostReads(model) as reads:
        loss, count = assistant_loss(model, examples, tokenizer.pad_token_id, 1)
    assert given == [["input_ids", "labels", "loss_positions", "num_items_in_batch", "skip_logits", "token_mask"]] * 3
    assert len(reads.reads) == 1, reads.reads
    assert (loss, count) == pytest.approx(hand_loss(model, tokenizer), rel=1e-5)


def test_a_task_that_is_not_a_string_is_refused_with_its_line(trained, tmp_path):
    # left out of by_task silently, the per-task counts would not add up to the rows that name a task
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"conversations": c, "task": t}) + "\n"
                            for c, t in zip(CONVERSATIONS, ("fact", 7, "chat"))), encoding="utf-8")
    done = script_in_process("eval_sft.py", "--model_path", str(trained["checkpoint"]), "--data_path", str(data),
                             "--device", "cpu")
    assert (done.returncode, done.stderr, done.stdout) == (2, f"error: {data}:2: 'task' must be a string, got int\n", "")


def test_a_blank_task_is_refused_with_its_line(trained, tmp_path):
    # counted under a blank name in by_task, a row of no task that reads as one
    for task in ("", "  "):
        data = tmp_path / "tasks.jsonl"
        data.write_text("".join(json.dumps({"conversations": c, "task": t}) + "\n"
                                for c, t in zip(CONVERSATIONS, ("fact", "sum", task))), encoding="utf-8")
        done = script_in_process("eval_sft.py", "--model_path", str(trained["checkpoint"]), "--data_path", str(data),
                                 "--device", "cpu")
        assert (done.returncode, done.stderr, done.stdout) == (
            2, f"error: {data}:3: 'task' must be a non-blank string, got {task!r}\n", "")


CALL = {"name": "calculator", "arguments": {"a": 31, "op": "*", "b": 76}}
CALL_ROWS = [  # the same turn: a structured call, the call written as text, and a reply with reasoning
    [{"role": "user", "content": "31*76?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]}],
    [{"role": "user", "content": "31*76?"},
     {"role": "assistant", "content": "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>"}],
    [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5", "reasoning_content": "add"}],
]


def test_a_tool_call_written_as_text_in_the_reference_is_scored_as_a_call(tmp_path):
    from dataset import load_tokenizer
    from scripts.eval_sft import read_examples, score

    data = tmp_path / "calls.jsonl"
    data.write_text("".join(json.dumps({"conversations": row}) + "\n" for row in CALL_ROWS), encoding="utf-8")
    examples = read_examples(data, load_tokenizer(None), 512)
    assert [(e.reference, e.reference_calls) for e in examples] == [("", [CALL]), ("", [CALL]), ("5", [])]
    answers = ["<think>\n\n</think>\n\n" + "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>"] * 2 + ["5"]
    result = score(answers, examples)
    assert (result["num_tool_calls_correct"], result["num_tool_call_turns"], result["num_correct"],
            result["num_replies"]) == (2, 2, 1, 1)


def test_after_the_templates_closed_think_block_an_answer_holding_a_think_tag_is_judged_whole(tmp_path, monkeypatch):
    # the prompt ends with the empty think block (thinking off): "I add.</think>\n\n5" is all answer, not the
    # reply "5" after reasoning; calls are read out of it as out of any answer
    import scripts.eval_sft as eval_sft
    from dataset import load_tokenizer

    data = tmp_path / "calls.jsonl"
    data.write_text("".join(json.dumps({"conversations": row}) + "\n" for row in CALL_ROWS), encoding="utf-8")
    tokenizer = load_tokenizer(None)
    examples = eval_sft.read_examples(data, tokenizer, 512)
    answers = ["x</think>\n\n<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>"] * 2 + ["I add.</think>\n\n5"]
    monkeypatch.setattr(eval_sft, "assistant_loss", lambda *args: (1.0, 3))
    monkeypatch.setattr(eval_sft, "greedy_answers", lambda *args: answers)
    result = eval_sft.evaluate(None, tokenizer, examples, 2, 8)
    assert (result["num_tool_calls_correct"], result["num_correct"]) == (2, 0)
    assert eval_sft.score(answers, examples)["num_correct"] == 1  # after a prompt that leaves the block open


def test_the_references_are_the_trainers_evaluation_ones_and_the_prompts_chats(tmp_path):
    # eval_sft.py judges by the trainer's references; its prompts are chat.py's (thinking off: the trainer's
    # prompt, which ends at the assistant header, and the template's empty think block)
    from types import SimpleNamespace

    from dataset import load_tokenizer
    from scripts.eval_sft import read_examples
    from trainer.data_setup import build_eval_sets

    data = tmp_path / "calls.jsonl"
    data.write_text("".join(json.dumps({"conversations": row}) + "\n" for row in [*CALL_ROWS, *CONVERSATIONS]),
                    encoding="utf-8")
    tokenizer = load_tokenizer(None)
    args = SimpleNamespace(eval_data_path=str(data), max_seq_len=512, bad_data="error", cache_dir=str(tmp_path),
                           packing=0, batch_size=2, eval_generate_samples=6, eval_max_new_tokens=4)
    ctx = SimpleNamespace(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    (eval_set,) = build_eval_sets(args, tokenizer, ctx, 512)
    examples = read_examples(data, tokenizer, 512)
    assert [(e.reference, e.reference_calls) for e in examples] == [
        (e.reference, e.reference_calls) for e in eval_set.examples]
    assert [e.prompt_ids for e in examples] == [
        e.prompt_ids + tokenizer.encode("<think>\n\n</think>\n\n") for e in eval_set.examples]
    assert tokenizer.decode(examples[2].prompt_ids) == ("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
                                                        "<think>\n\n</think>\n\n")
    assert [e.reference for e in examples[2:]] == ["5", "Velm", "5", "blue"]


def test_a_template_that_closes_no_turn_with_a_token_is_refused_with_the_line(tmp_path):
    # the answer of such a turn has no end to stop at or to judge by (the trainer has no prompt from it either)
    from dataset import DataError, load_tokenizer
    from scripts.eval_sft import read_examples
    from tests.helpers.templates import with_template

    tokenizer = with_template(load_tokenizer(None), "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                                                    "{% if add_generation_prompt %}assistant: {% endif %}")
    data = tmp_path / "plain.jsonl"
    data.write_text(json.dumps({"conversations": CONVERSATIONS[1]}) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as raised:
        read_examples(data, tokenizer, 512)
    assert str(raised.value) == (f"{data}:1: its last assistant turn does not end with the chat template's "
                                 "end-of-turn token: there is no answer to judge")


def test_a_max_new_tokens_that_leaves_no_room_is_refused_as_the_trainer_refuses_its_flag(trained, tmp_path):
    # the trainer's line for --eval_max_new_tokens (trainer/evaluation/evaluate.py, no_room_problem), naming ours
    out = tmp_path / "result.json"
    done = script_in_process("eval_sft.py", "--model_path", str(trained["run_dir"]), "--data_path", str(trained["data"]),
                             "--max_new_tokens", "512", "--json_out", str(out), "--device", "cpu")
    assert (done.returncode, done.stderr) == (
        2, "error: --max_new_tokens 512 leaves no room for a prompt in the model's context of 512 tokens\n")
    assert not out.exists()


def test_prompts_longer_than_the_context_less_max_new_tokens_are_counted_in_one_line(trained, tmp_path):
    # answered from their last tokens (the system prompt cut off): said, once, with how to avoid it
    from scripts.eval_sft import read_examples

    data = tmp_path / "long.jsonl"
    long = [{"role": "system", "content": "word " * 400}, *CONVERSATIONS[1]]
    data.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in [long, *CONVERSATIONS]), encoding="utf-8")
    assert [len(e.prompt_ids) > 512 - 128 for e in read_examples(data, trained["tokenizer"], 512)] == [
        True, False, False, False]
    out = tmp_path / "result.json"
    for new_tokens, lines in (("128", ["warning: 1 of 4 prompts are longer than the model's context (512) minus "
                                       "--max_new_tokens (128): answered from their last 384 tokens (lower "
                                       "--max_new_tokens)"]),
                              ("8", [])):
        done = script_in_process("eval_sft.py", "--model_path", str(trained["run_dir"]), "--data_path", str(data),
                                 "--max_new_tokens", new_tokens, "--json_out", str(out), "--device", "cpu")
        assert (done.returncode, done.stderr.splitlines()) == (0, lines)
