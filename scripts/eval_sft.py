"""Evaluate a trained model on SFT conversations: assistant-token loss, perplexity, exact match, tool calls.

    python scripts/eval_sft.py --model_path out [--data_path dataset/demo/sft_eval.jsonl] [--json_out r.json]

* loss: mean cross-entropy over all assistant tokens of the file (token-weighted, the same
  assistant-only mask as training), perplexity = exp(loss);
* for each conversation, the prompt is the messages before its final assistant turn (and its
  tools) with the chat template's generation prompt, as ``scripts/chat.py`` asks (the shipped
  template's: thinking off, an empty think block); the reference is that turn as the trainer's
  evaluation takes it (``trainer.evaluation.evaluate.generation_example``): a call in it counts as
  a call whether it is a ``tool_calls`` entry or ``<tool_call>`` text in the content. The trainer's
  ``--eval_generate_samples`` prompts end at the assistant header instead, so the model writes its
  own think block there (docs/evaluation.md). The greedy answer up to the end-of-turn token and the
  reference are split into reasoning, reply and tool calls (``dataset.tool_calls``); after a prompt
  whose think block is closed (the shipped template's) the answer is all reply and calls;
* exact match (conversations whose final turn is a reply): the reply must equal the reference
  after stripping whitespace, and the model must not call a tool;
* tool-call accuracy (conversations whose final turn calls tools): the calls must be the
  reference calls: same names, JSON-equal arguments, any order;
* by task: rows that carry a ``task`` key (the demo's held-out file does: ``fact_capital``,
  ``tool_call``, ...) are also counted per task, right / total; a ``task`` that is not a string, or
  is blank (``""``), is refused with its line.

A ``--max_seq_len`` (or model context) that cuts every conversation before its first answer token
leaves no loss to compute: refused in one line, as the trainer refuses such a held-out file.

Prints a table; the JSON result goes to ``--json_out`` (then the table is on stdout) or to stdout
(then the table is on stderr).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._common import (  # noqa: E402
    REPO_DIR, ArgumentParser, add_model_args, check_not_an_input, check_output_file, fail, load_model_and_tokenizer,
    prompt_ids, run_main, write_output,
)
from trainer.args import Bounds, flag_bounds, path_value  # noqa: E402

DEFAULT_DATA = REPO_DIR / "dataset" / "demo" / "sft_eval.jsonl"


@dataclass
class Example:
    """One conversation: its training encoding cut to --max_seq_len (for the loss), and its final turn's
    prompt and reference (``generation_example``)."""

    line: int
    input_ids: list[int]
    loss_mask: list[bool]
    prompt_ids: list[int]
    reference: str
    reference_calls: list[dict]
    task: str | None = None


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[0], prog="eval_sft.py")
    add_model_args(parser)
    parser.add_argument("--data_path", default=str(DEFAULT_DATA), help="conversations (MiniMind/ShareGPT/OpenAI) in a .jsonl, .jsonl.gz or .parquet file")
    parser.add_argument("--max_seq_len", type=int, default=1024,
                        help="conversations are truncated to this for the loss (at least 2, as in training: the "
                             "first token has no label)").bounds = flag_bounds("max_seq_len")
    parser.add_argument("--batch_size", type=int, default=16,
                        help="conversations per forward / generate call").bounds = flag_bounds("batch_size")
    parser.add_argument("--max_new_tokens", type=int, default=128,
                        help="most tokens generated per answer").bounds = flag_bounds("eval_max_new_tokens")
    parser.add_argument("--limit", type=int, default=None,
                        help="evaluate only the first N conversations").bounds = Bounds(at_least=1)
    parser.add_argument("--json_out", default=None, type=path_value, help="write the JSON result here (default: stdout)")
    return parser


def check_data_path(path: Path) -> None:
    """Refuse, before the model loads, a --data_path that is no readable data file: a directory (this
    command reads one file, not the trainer's shards), or what the trainer refuses a file for
    (missing, empty, one JSON array, UTF-16, ...: ``dataset.sources.check_data_file``)."""
    from dataset.sources import check_data_file

    if path.is_dir():
        fail(f"--data_path {path} is a directory: eval_sft.py reads one .jsonl, .jsonl.gz, .json or .parquet file")
    check_data_file(path)


def read_examples(path: Path, tokenizer, max_seq_len: int, limit: int | None = None) -> list[Example]:
    """Parse and encode the file, read as training reads it (``dataset.sources``); a bad line raises ``DataError("file:line: problem")``."""
    import numpy as np

    from dataset import IGNORE_INDEX, DataError, encode_conversation
    from dataset.formats import ROW_KEYS, Conversation, LineError, decode_line, load_row, parse_row
    from dataset.sources import check_data_file, open_lines
    from trainer.evaluation.evaluate import generation_example, stop_token_ids

    check_data_file(path)
    stop_ids = stop_token_ids(tokenizer)
    examples = []
    lines = open_lines(path, (*ROW_KEYS, "task"))  # the reader of training: .jsonl, .jsonl.gz, .parquet
    for number, raw in enumerate(lines, start=1):
        if limit is not None and len(examples) >= limit:
            break
        if not raw.strip():
            continue
        try:
            row = load_row(decode_line(raw))
            conversation = parse_row(row)
            messages = conversation.messages
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            if last == 0:
                raise LineError("no assistant answer after a prompt")
            task = row.get("task")  # parquet: null where a row has none
            if task is not None and not isinstance(task, str):  # by_task counts it under its name
                raise LineError(f"'task' must be a string, got {type(task).__name__}")
            if task is not None and not task.strip():  # a blank name in by_task: a row of no task that reads as one
                raise LineError(f"'task' must be a non-blank string, got {task!r}")
            # whole, for the reference; the loss reads its first max_seq_len tokens, as training does
            ids, mask = encode_conversation(tokenizer, Conversation(messages[: last + 1], conversation.tools),
                                            sys.maxsize)
            answer = generation_example(ids, np.where(mask, ids, IGNORE_INDEX), tokenizer, stop_ids)
            if answer is None:
                raise LineError("its last assistant turn does not end with the chat template's end-of-turn token: "
                                "there is no answer to judge")
        except LineError as error:
            raise DataError(f"{path}:{number}: {error}") from None
        examples.append(Example(number, ids[:max_seq_len].tolist(), mask[:max_seq_len].tolist(),
                                prompt_ids(tokenizer, messages[:last], conversation.tools), answer.reference,
                                answer.reference_calls, task))
    if not examples:
        raise DataError(f"{path}: no conversations to evaluate")
    return examples


def scored_examples(examples: list[Example]) -> list[Example]:
    """The examples with an answer token inside --max_seq_len: those the loss counts (the first
    token is never predicted)."""
    return [e for e in examples if any(e.loss_mask[1:])]


def length_limit(max_seq_len: int, context: int) -> tuple[int, str, str]:
    """(the tokens of a conversation the loss reads, what sets that number, how to read more: "" where
    the model's context sets it, as the model cannot see more)."""
    if max_seq_len < context:
        return max_seq_len, f"--max_seq_len {max_seq_len}", "raise --max_seq_len"
    return context, f"the model's context of {context} tokens", ""


def check_loss_tokens(path: Path, examples: list[Example], limit: str, remedy: str) -> None:
    """Fail when no example keeps an answer token: the loss would be 0/0. The trainer refuses such a
    held-out file too (dataset/cache/build.py: no usable samples); examples that the limit cuts while
    others keep a token are named in a warning."""
    scored = len(scored_examples(examples))
    if not scored:
        which = (f"all {len(examples)} conversations before their" if len(examples) > 1
                 else "the one conversation before its")
        fail(f"{path}: no loss token to evaluate: {limit} cuts {which} first answer token"
             + (f" ({remedy})" if remedy else ""))
    if scored < len(examples):  # said, not left out of the loss silently
        print(f"warning: {len(examples) - scored} of {len(examples)} conversations keep no answer token within "
              f"{limit}: the loss counts the other {scored}" + (f" ({remedy} to count them)" if remedy else ""),
              file=sys.stderr)


def assistant_loss(model, examples: list[Example], pad_token_id: int, batch_size: int) -> tuple[float, int]:
    """(mean CE over all assistant tokens, number of those tokens), token-weighted over every batch.
    Examples without such a token (none given, or all cut before their answer) raise ``DataError``:
    their loss is 0/0. The command refuses them first, naming the file (``check_loss_tokens``)."""
    import numpy as np
    import torch

    from dataset import IGNORE_INDEX, DataError, SFTCollator, model_inputs

    usable = scored_examples(examples)
    if not usable:
        raise DataError(f"no loss token to evaluate: none of the {len(examples)} conversations given has an "
                        "assistant token after its first token")
    collate = SFTCollator(pad_token_id=pad_token_id)
    total, count = torch.zeros((), dtype=torch.float64, device=model.device), 0
    for start in range(0, len(usable), batch_size):
        items = []
        for example in usable[start:start + batch_size]:
            ids = np.asarray(example.input_ids, dtype=np.int64)
            items.append({"input_ids": ids, "labels": np.where(example.loss_mask, ids, IGNORE_INDEX)})
        batch = collate(items)
        count += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())  # on the host, before the batch moves
        with torch.inference_mode():  # the trainer's inputs: right padding, causal, no attention mask
            total += model(**model_inputs(batch, model.device), num_items_in_batch=1, skip_logits=True).loss
    return float(total) / count, count


def greedy_answers(model, tokenizer, examples: list[Example], batch_size: int, max_new_tokens: int) -> list[str]:
    """Greedy answers of all prompts (batched, left padding; trainer.evaluation.greedy_generate); a line
    says how many prompts are answered from their end only, the model's context less --max_new_tokens."""
    from trainer.evaluation.evaluate import greedy_generate, long_prompts, no_room_problem, stop_token_ids

    context = model.config.max_position_embeddings
    problem = no_room_problem(context, max_new_tokens, "--max_new_tokens")
    if problem:
        fail(problem)
    prompts = [e.prompt_ids for e in examples]
    cut = long_prompts(prompts, context, max_new_tokens, "--max_new_tokens")
    if cut:
        print(f"warning: {cut}", file=sys.stderr)
    answers = greedy_generate(model, prompts, tokenizer.pad_token_id, stop_token_ids(tokenizer), batch_size,
                              max_new_tokens)
    return [tokenizer.decode(answer, skip_special_tokens=True) for answer in answers]


def score(answers: list[str], examples: list[Example], think_closed: bool = False) -> dict:
    """Exact match over the reply references, tool-call accuracy over the tool-call references;
    `think_closed`: the prompts closed the think block (``dataset.tool_calls.prompt_closes_think``),
    so all of an answer is reply and calls."""
    from trainer.evaluation.evaluate import answer_is_right  # the same judgement as the trainer's evaluation

    correct = calls_correct = num_calls = 0
    by_task: dict[str, list[int]] = {}
    for answer, example in zip(answers, examples):
        right = answer_is_right(answer, example.reference, example.reference_calls, think_closed)
        if example.task is not None:
            counts = by_task.setdefault(example.task, [0, 0])
            counts[0] += right
            counts[1] += 1
        if example.reference_calls:
            num_calls += 1
            calls_correct += right
        else:
            correct += right
    num_replies = len(examples) - num_calls
    return {
        "exact_match": correct / num_replies if num_replies else float("nan"),
        "num_correct": correct,
        "num_replies": num_replies,
        "tool_call_accuracy": calls_correct / num_calls if num_calls else float("nan"),
        "num_tool_calls_correct": calls_correct,
        "num_tool_call_turns": num_calls,
        "by_task": {task: {"right": right, "total": total} for task, (right, total) in sorted(by_task.items())},
    }


def evaluate(model, tokenizer, examples: list[Example], batch_size: int, max_new_tokens: int) -> dict:
    """The command's result for ``examples``: loss, perplexity, exact match, tool calls, per task.
    Examples without a loss token raise ``DataError`` (``assistant_loss``), before anything is generated."""
    from dataset.tool_calls import prompt_closes_think

    loss, num_tokens = assistant_loss(model, examples, tokenizer.pad_token_id, batch_size)
    answers = greedy_answers(model, tokenizer, examples, batch_size, max_new_tokens)
    try:
        perplexity = math.exp(loss)
    except OverflowError:
        perplexity = float("inf")
    return {
        "loss": loss,
        "perplexity": perplexity,
        **score(answers, examples, prompt_closes_think(tokenizer)),  # the prompts are the template's
        "num_conversations": len(examples),
        "num_loss_tokens": num_tokens,
    }


def finite_or_null(value):
    """`value` with every NaN or infinity (no reply to score, no tool-call turn, an infinite
    perplexity) as None: JSON has no NaN, and a reader of the file would fail on `NaN`."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    return value


def format_table(result: dict) -> str:
    from dataset.printable import printable

    rows = [
        ("conversations", f"{result['num_conversations']}"),
        ("loss tokens", f"{result['num_loss_tokens']}"),
        ("loss", f"{result['loss']:.4f}"),
        ("perplexity", f"{result['perplexity']:.4f}"),
    ]
    if result["num_replies"]:  # a figure of no reply turn is null in the JSON, and no row here
        rows.append(("exact match", f"{result['exact_match']:.4f} ({result['num_correct']}/{result['num_replies']})"))
    if result["num_tool_call_turns"]:
        rows.append(("tool calls", f"{result['tool_call_accuracy']:.4f} "
                                   f"({result['num_tool_calls_correct']}/{result['num_tool_call_turns']})"))
    if result["by_task"]:
        rows.append(("by task", "right/total"))
        rows += [(f"  {printable(task)}", f"{counts['right']}/{counts['total']}")  # task names from the data
                 for task, counts in result["by_task"].items()]
    width = max(14, *(len(name) for name, _ in rows))
    return "\n".join(f"{name:<{width}} {value}" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # ranges checked (scripts/_common.ArgumentParser)
    check_output_file(args.json_out, "--json_out")
    check_not_an_input(args.json_out, "--json_out", [args.data_path])
    check_data_path(Path(args.data_path))
    model, tokenizer = load_model_and_tokenizer(args)
    max_seq_len, limit, remedy = length_limit(args.max_seq_len, model.config.max_position_embeddings)
    examples = read_examples(Path(args.data_path), tokenizer, max_seq_len, args.limit)
    check_loss_tokens(Path(args.data_path), examples, limit, remedy)
    result = evaluate(model, tokenizer, examples, args.batch_size, args.max_new_tokens)
    text = json.dumps(finite_or_null(result), indent=2, allow_nan=False)
    if args.json_out:
        write_output(args.json_out, text + "\n")
        print(format_table(result))
    else:
        print(format_table(result), file=sys.stderr)
        print(text)
    return 0


if __name__ == "__main__":
    run_main(main)
