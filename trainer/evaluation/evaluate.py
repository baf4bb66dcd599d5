"""Evaluation on held-out data: the figures that say which checkpoint to keep.

For every held-out file (`--eval_data_path a.jsonl,b.jsonl`), on every `--eval_interval`:

* loss: mean cross-entropy over all loss (assistant) tokens, token-weighted;
* token accuracy: the fraction of those tokens whose greedy (argmax) prediction is the label;
* with `--eval_generate_samples N`: the first N conversations of the file are answered greedily
  (at most `--eval_max_new_tokens` tokens, stopping at the template's end-of-turn token or eos,
  `stop_token_ids`). The prompt is the sample's tokens before its last assistant turn, the
  reference is that turn; reasoning (`<think>...</think>`) is split off both
  (`dataset.tool_calls`). Exact match (turns without tool calls): the reply equals the reference,
  whitespace stripped at both ends, and calls no tool. Tool-call accuracy (turns with tool
  calls): the same calls, names equal and arguments JSON-equal, in any order.

Every rank evaluates a disjoint slice (every world_size-th sample from its rank) and all figures
are sums, reduced in one all-reduce at the end: N ranks give the same numbers as one.
`generation_example` (the prompt and reference of a conversation), `greedy_generate` and
`answer_is_right` are shared with `scripts/eval_sft.py`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from dataset import IGNORE_INDEX, model_inputs
from dataset.prefix_tokens import encode_text
from dataset.tool_calls import calls_match, parse_reply
from model.loss import loss_positions_of
from trainer.evaluation.selection import METRICS
from trainer.runtime.distributed import all_reduce_sum
from trainer.runtime.precision import autocast

# The sums kept per held-out file, in this order in the all-reduced tensor.
SUMS = ("loss_sum", "tokens", "tokens_correct", "replies", "replies_correct", "tool_turns", "tool_turns_correct")


@dataclass
class GenerationExample:
    """One prompt of the generation subset: token ids before the last assistant turn, and that
    turn as text with its tool calls (judged by tool-call accuracy when it has any, else by exact match)."""

    prompt_ids: list[int]
    reference: str
    reference_calls: list[dict]


@dataclass
class EvalSet:
    """One held-out file: its name in the metrics, this rank's loss loader and generation share."""

    name: str
    loader: object
    forwards: int = 0  # loss batches of the rank with the most: every rank runs that many forwards
    examples: list[GenerationExample] = field(default_factory=list)  # this rank's share
    num_replies: int = 0  # in the whole generation subset (all ranks): answers judged by exact match
    num_tool_turns: int = 0  # ... and answers judged by tool-call accuracy
    # What its figures are measured on: the file's content, the tokenizer and chat template, --max_seq_len
    # (dataset.cache.key.measurement_key), and how many of its rows are samples.
    data_key: str = ""
    num_samples: int = 0


# A private-use character no template emits: marks where the reply's text ends in a rendering.
PROBE = "\ue000"


def end_of_turn_token_id(tokenizer) -> int | None:
    """The token that closes an assistant turn in the tokenizer's chat template (ChatML:
    `<|im_end|>`), which need not be its eos (Qwen base tokenizers: `<|endoftext|>`): a conversation
    of one exchange is rendered, and the first special token after the reply is taken. None when the
    template closes the turn with no special token."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    special = set(tokenizer.all_special_ids) | {
        token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}
    for token_id in encode_text(tokenizer, text[text.rindex(PROBE) + len(PROBE):])[0]:
        if token_id in special:
            return token_id
    return None


def stop_token_ids(tokenizer) -> list[int]:
    """Where an answer ends: the template's end-of-turn token, and eos where that is another token."""
    found = [end_of_turn_token_id(tokenizer), tokenizer.eos_token_id]
    return list(dict.fromkeys(token_id for token_id in found if token_id is not None))


def last_assistant_turn(input_ids: np.ndarray, labels: np.ndarray, stop_ids) -> tuple[int, int] | None:
    """[start, end) of the last run of loss tokens, if it ends with an end-of-turn token (one of
    `stop_ids`, an id or a list of ids; not truncated)."""
    stop_ids = {stop_ids} if isinstance(stop_ids, int) else set(stop_ids)
    positions = np.flatnonzero(labels != IGNORE_INDEX)
    if len(positions) == 0 or int(input_ids[positions[-1]]) not in stop_ids:
        return None
    gaps = np.flatnonzero(np.diff(positions) > 1)
    start = int(positions[gaps[-1] + 1]) if len(gaps) else int(positions[0])
    if start == 0:
        return None
    return start, int(positions[-1]) + 1


def generation_example(input_ids: np.ndarray, labels: np.ndarray, tokenizer, stop_ids) -> GenerationExample | None:
    """The prompt and reference of one encoded conversation (a held-out sample here, a row of
    `scripts/eval_sft.py`): the tokens before its last assistant turn, so the model writes its own
    think block, and that turn decoded and split by `parse_reply` (a call in `tool_calls` and one
    written as `<tool_call>` text render alike, and are read alike). None when the turn is not whole
    (`last_assistant_turn`)."""
    span = last_assistant_turn(input_ids, labels, stop_ids)
    if span is None:
        return None
    start, end = span
    ids = input_ids.tolist()
    reference = parse_reply(tokenizer.decode(ids[start:end - 1], skip_special_tokens=True))
    return GenerationExample(ids[:start], reference.content, reference.calls)


def generation_examples(dataset, count: int, tokenizer, max_seq_len: int) -> list[GenerationExample]:
    """The first `count` usable samples of an (unpacked) SFT dataset as prompts and references.

    A sample of `max_seq_len` tokens gives none: the cache's truncation may have cut its later turns
    away and left an earlier answer whole, which is not the conversation's last turn (the one
    `scripts/eval_sft.py` judges, and whose kind sorts it into exact match or tool-call accuracy); the
    tokens cannot tell that from a conversation that fills `max_seq_len` exactly. A change of this
    rule is a new `selection.PROMPT_RULE`."""
    stop_ids = stop_token_ids(tokenizer) if count else []
    examples = []
    for index in range(len(dataset)):
        if len(examples) >= count:
            break
        sample = dataset[index]
        if len(sample["input_ids"]) >= max_seq_len:
            continue
        example = generation_example(sample["input_ids"], sample["labels"], tokenizer, stop_ids)
        if example is not None:
            examples.append(example)
    return examples


def metric_names(eval_sets: list[EvalSet]) -> list[str]:
    """The metric keys an evaluation of these held-out files reports (for --keep_best)."""
    def names(replies: int, tool_turns: int) -> list[str]:
        skip = {"eval_exact_match"} if not replies else set()
        skip |= {"eval_tool_call_accuracy"} if not tool_turns else set()
        return [key for key in METRICS if key not in skip]

    result = names(sum(s.num_replies for s in eval_sets), sum(s.num_tool_turns for s in eval_sets))
    if len(eval_sets) > 1:
        result += [f"{key}/{s.name}" for s in eval_sets for key in names(s.num_replies, s.num_tool_turns)]
    return result


# --------------------------------------------------------------------------- generation


def no_room_problem(context: int, max_new_tokens: int, flag: str) -> str | None:
    """The line that refuses `flag`, the setting of `max_new_tokens`, where the answer's room leaves no
    token of the model's context of `context` to a prompt; None where a prompt has room. The trainer's
    evaluation and scripts/eval_sft.py refuse it before they generate, each naming its own flag
    (scripts/chat.py refuses none: it drops old exchanges until its prompt fits and caps each answer at
    the room left)."""
    if max_new_tokens < context:
        return None
    return f"{flag} {max_new_tokens} leaves no room for a prompt in the model's context of {context} tokens"


def prompt_room(context: int, max_new_tokens: int) -> int:
    """The most tokens of a prompt that generation keeps: the model's context less the answer's room."""
    problem = no_room_problem(context, max_new_tokens, "max_new_tokens")
    if problem:  # the callers refused it already (`no_room_problem`): a bug of ours here
        raise ValueError(problem)
    return context - max_new_tokens


def long_prompts(prompts: list[list[int]], context: int, max_new_tokens: int, flag: str) -> str | None:
    """What `greedy_generate` does to the prompts longer than `prompt_room` (it answers them from their
    last tokens: their start, the system prompt and the tools, unseen), as a line for a warning; None when
    every prompt fits. `flag` names the setting of `max_new_tokens`, advised lower where that would let
    one of them fit (one shorter than the context)."""
    keep = prompt_room(context, max_new_tokens)
    cut = [len(ids) for ids in prompts if len(ids) > keep]
    if not cut:
        return None
    return (f"{len(cut)} of {len(prompts)} prompts are longer than the model's context ({context}) minus {flag} "
            f"({max_new_tokens}): answered from their last {keep} tokens"
            + (f" (lower {flag})" if min(cut) < context else ""))


@torch.no_grad()
def greedy_generate(model, prompts: list[list[int]], pad_token_id: int, eos_token_id: int | list[int],
                    batch_size: int, max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations (token ids, up to and without the first stop token: `eos_token_id`, an id
    or a list such as `stop_token_ids`) of all prompts, batched with left padding, longest prompts
    first. A prompt longer than the model's context minus `max_new_tokens` keeps its end (the callers
    say how many do, once per held-out set: `long_prompts`)."""
    stop_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    keep = prompt_room(model.config.max_position_embeddings, max_new_tokens)
    prompts = [ids[-keep:] for ids in prompts]
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    device = next(model.parameters()).device
    answers: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = max(len(prompts[i]) for i in chunk)
        input_ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, index in enumerate(chunk):
            ids = prompts[index]
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
        # Eagerly, also where training compiled the blocks (--use_compile 1): a block's compiled
        # code guards on the state of its own layer's KV cache, so generation would compile it
        # again for every layer, up to dynamo's recompile limit, which training's blocks share.
        with torch.compiler.set_stance("force_eager"):
            output = model.generate(
                input_ids.to(device), attention_mask=attention_mask.to(device), max_new_tokens=max_new_tokens,
                do_sample=False, eos_token_id=stop_ids, pad_token_id=pad_token_id,
            )
        for row, index in enumerate(chunk):
            generated = output[row, width:].tolist()
            ends = [generated.index(token_id) for token_id in stop_ids if token_id in generated]
            answers[index] = generated[: min(ends)] if ends else generated
    return answers


def exact_match(answer: str, reference: str) -> bool:
    return answer.strip() == reference.strip()


def answer_is_right(answer: str, reference: str, reference_calls: list[dict], think_closed: bool = False) -> bool:
    """Judge one generated answer (text after the generation prompt; reasoning is split off, unless
    `think_closed`: the prompt closed the think block, so all of the answer is reply and calls).
    A reference with tool calls: the answer makes the same calls (names equal, arguments
    JSON-equal, any order) and no malformed call. Otherwise: the reply equals the reference
    (exact match) and calls no tool."""
    reply = parse_reply(answer, think_closed)
    if reference_calls:
        return calls_match(reply.calls, reference_calls) and not reply.bad_calls
    return exact_match(reply.content, reference) and not (reply.calls or reply.bad_calls)


# --------------------------------------------------------------------------- loss and token accuracy


def loss_and_accuracy_sums(model, loader, device: torch.device, dtype: torch.dtype, forwards: int = 0) -> torch.Tensor:
    """[sum of token losses, loss tokens, correctly predicted loss tokens] over this rank's batches.

    `forwards`: run at least that many forward passes, the missing ones on a one-token batch
    without loss tokens. Under --fsdp 1 every forward is a collective, so all ranks run the same
    number although their slices may differ by one batch.

    The model computes its LM head only at the loss positions (`skip_logits=True`), one call per
    chunk of them; a hook on the head keeps the argmax of each call's logits, not the logits, so
    the accuracy costs no second forward and holds one chunk's logits at a time. (A change of the
    model that calls the head elsewhere fails here on the size, loudly.)

    Nothing is read from the device: the loss positions of the CPU batch (the collator's, else
    computed from its labels; none in the padding batch) give the count on the host and the
    targets by index, in the order of the head's rows. The caller reads the sums, once."""
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    captured = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda _module, _inputs, logits: captured.append(logits.reshape(-1, logits.shape[-1]).argmax(dim=-1)))
    padding = {"input_ids": torch.zeros((1, 2), dtype=torch.long),
               "labels": torch.full((1, 2), IGNORE_INDEX, dtype=torch.long),
               "loss_positions": torch.zeros(0, dtype=torch.long)}  # no loss tokens: adds 0 to every sum
    try:
        batches = itertools.chain(loader, itertools.repeat(padding))
        for index, batch in enumerate(batches):
            if index >= max(forwards, len(loader)):
                break
            if "loss_positions" not in batch:
                batch = {**batch, "loss_positions": loss_positions_of(batch["labels"])}
            captured.clear()
            inputs = model_inputs(batch, device)  # the same inputs as training
            with autocast(device, dtype):
                out = model(**inputs, num_items_in_batch=1, skip_logits=True)
            targets = inputs["labels"].reshape(-1)[inputs["loss_positions"] + 1]  # the next token of the row
            totals[0] += out.loss.double()
            totals[1] += len(batch["loss_positions"])
            # the head's predictions at the loss positions, in order (one call per chunk)
            predicted = torch.cat(captured or [targets])
            totals[2] += (predicted == targets).sum()
    finally:
        hook.remove()
    return totals


def set_sums(run, eval_set: EvalSet) -> torch.Tensor:
    """This rank's SUMS for one held-out file."""
    model, device, args = run.raw_model, run.ctx.device, run.args
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)
    sums[:3] = loss_and_accuracy_sums(model, eval_set.loader, device, run.dtype, eval_set.forwards)
    if eval_set.examples:
        with autocast(device, run.dtype):
            answers = greedy_generate(model, [e.prompt_ids for e in eval_set.examples], run.tokenizer.pad_token_id,
                                      stop_token_ids(run.tokenizer), args.batch_size, args.eval_max_new_tokens)
        for answer, example in zip(answers, eval_set.examples):
            right = answer_is_right(run.tokenizer.decode(answer, skip_special_tokens=True), example.reference,
                                    example.reference_calls)
            column = SUMS.index("tool_turns" if example.reference_calls else "replies")
            sums[column] += 1
            sums[column + 1] += right
    return sums


def figures(sums: list[float]) -> dict:
    """The reported figures of one file (or of all files together) from its reduced SUMS."""
    values = dict(zip(SUMS, sums))
    result = {
        "eval_loss_tokens": int(values["tokens"]),
        "eval_loss": values["loss_sum"] / values["tokens"] if values["tokens"] else None,
        "eval_token_accuracy": values["tokens_correct"] / values["tokens"] if values["tokens"] else None,
    }
    if values["replies"]:
        result["eval_exact_match"] = values["replies_correct"] / values["replies"]
    if values["tool_turns"]:
        result["eval_tool_call_accuracy"] = values["tool_turns_correct"] / values["tool_turns"]
    return result


@torch.no_grad()
def evaluate(run) -> dict:
    """All figures of all held-out files, reduced over ranks (a collective: every rank calls it).

    The raw (unwrapped) model runs in eval mode; its train/eval mode is restored afterwards.
    With one file the keys are `eval_loss`, `eval_token_accuracy`, `eval_exact_match`; with
    several, each file also has `eval_loss/<name>` etc. and the plain keys cover all files."""
    model = run.raw_model
    was_training = model.training
    model.eval()
    try:
        sums = torch.stack([set_sums(run, eval_set) for eval_set in run.eval_sets])
    finally:
        model.train(was_training)
    sums = all_reduce_sum(sums).tolist()
    result = figures([sum(column) for column in zip(*sums)])
    if len(run.eval_sets) > 1:
        for eval_set, row in zip(run.eval_sets, sums):
            result.update({f"{key}/{eval_set.name}": value for key, value in figures(row).items()})
    return {key: value for key, value in result.items() if value is not None and not _nan(value)}


def _nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)
