"""Write the deterministic bilingual demo SFT set (MiniMind jsonl format).

The data teaches a small, learnable skill set:

* facts about a fixed table of fictional countries (capital, flag colour, lucky number),
  asked in English and Chinese with several phrasings;
* addition of two numbers from 1 to 5;
* formatting: uppercase a word from a fixed list, reverse a list of three letters;
* a few fixed greetings.

Samples are single- or multi-turn, some carry a short or a long system prompt (and some a
"reference notes" system prompt listing facts), so lengths vary from ~20 to several hundred
tokens. Every answer is short and in a fixed format.

About one training conversation in three (4,000 of 11,000 by default) has the demo tools
(``dataset/demo_tools.py``: ``lookup_country`` and ``calculator``) on its system message and
asks one to four questions answered by calling them: one lookup, one calculation, or two lookups
in parallel followed by a calculation, each call followed by its tool result and the final
answer; a later lookup may be a follow-up that does not name its country again ("And its
capital?"), and greetings in such conversations are answered without a call. Several questions
share one tools block, so most of the tokens of a tool conversation carry a call or an answer to
learn (the block alone is 248 tokens); every tool conversation fits 1024 tokens. Numbers are
JSON numbers in calls and results and the answer after a calculation is a sentence ("The result
is 444."), so a number is the same tokens, leading space included, wherever the model has to
copy it. A third of the tool calls and a tenth of the plain answers carry a short reasoning
trace (``reasoning_content``).

The eval split asks about the same facts / sums / words as the train split, but only with
question phrasings that never occur in train: a question is a prefix ("Quick question: ", …)
plus a core sentence, and about a quarter of the (prefix, core) combinations are held out. Each plain eval line is a single question whose last
message is the exact reference answer, plus a ``task`` key for per-task accuracy. The tool eval
lines (appended after the plain ones) are tool conversations of one to three questions cut after
one of their assistant turns: a tool call (``tool_call``, ``tool_call_step2``: the calculation
after two lookups) or the answer after the tool results (``tool_answer``); the earlier questions
stay as history.

Usage: python scripts/make_demo_data.py [--out-dir dataset/demo] [--train-size 7000] [--eval-size 300]
"""

from __future__ import annotations

import functools
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._common import REPO_DIR, ArgumentParser, fail, run_main  # noqa: E402
from trainer.args import path_value  # noqa: E402
from scripts._demo_plain import (  # noqa: E402
    FIELD_OF, GREETINGS, PREFIXES, country_name, is_eval_phrasing, make_eval_sample, make_train_sample, phrasings,
)

from dataset.demo_tools import COUNTRIES, TOOLS, run_tool  # noqa: E402
from dataset.formats import parse_row  # noqa: E402
from dataset.rendering import load_tokenizer  # noqa: E402
from dataset.tokens import encode_conversation  # noqa: E402

# ----------------------------------------------------------------------------- tool conversations

TOOL_SYSTEM = ["", "You are a helpful assistant that can use tools.", "你是一个可以使用工具的助手。"]
CALC_CORES = {
    "en": ["What is {a} times {b}?", "Multiply {a} by {b}.", "What is {a} plus {b}?", "Compute {a} - {b}.",
           "Use the calculator for {a} * {b}.", "How much is {a} + {b}?"],
    "zh": ["算一下 {a} 乘以 {b} 等于多少？", "请计算 {a} 减 {b}。", "请问 {a} 加 {b} 是多少？", "用计算器算一下 {a} * {b}。"],
}
SUM_CORES = {
    "en": ["What is the lucky number of {x} plus the lucky number of {y}?",
           "Add the lucky numbers of {x} and {y}.",
           "What do the lucky numbers of {x} and {y} sum to?",
           "Lucky number of {x} + lucky number of {y}?"],
    "zh": ["{x}的幸运数字加上{y}的幸运数字是多少？", "请把{x}和{y}的幸运数字相加。", "{x}和{y}的幸运数字之和是多少？"],
}
RESULT_EN, RESULT_ZH = "The result is {}.", "结果是 {}。"
OPERATOR_WORDS = {"times": "*", "by": "*", "*": "*", "乘": "*", "plus": "+", "+": "+", "加": "+", "-": "-", "减": "-"}


def tool_phrasing(cores: dict, lang: str, split: str, rng: random.Random) -> str:
    """A (prefix, core) question template of ``split``, as for the plain questions."""
    want_eval = split == "eval"
    options = [
        prefix + core
        for i, prefix in enumerate(PREFIXES[lang])
        for j, core in enumerate(cores[lang])
        if is_eval_phrasing(i, j) == want_eval
    ]
    return rng.choice(options)


def operator_of(core: str) -> str:
    for word, symbol in OPERATOR_WORDS.items():
        if word in core.replace("{a}", "").replace("{b}", ""):
            return symbol
    raise ValueError(core)


def call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments}


def thought(rng: random.Random, lang: str, en: str, zh: str) -> dict:
    """A reasoning trace for a third of the tool-calling turns."""
    return {"reasoning_content": en if lang == "en" else zh} if rng.random() < 1 / 3 else {}


FOLLOW_UPS = {  # a lookup about the country of the previous question, which it does not name again
    ("capital", "en"): ["And its capital?", "What about its capital?", "Which city is its capital?"],
    ("capital", "zh"): ["那它的首都呢？", "它的首都是哪里？"],
    ("colour", "en"): ["And its flag colour?", "What colour is its flag?", "And the colour of its flag?"],
    ("colour", "zh"): ["那它的国旗是什么颜色？", "它的国旗颜色呢？"],
    ("number", "en"): ["And its lucky number?", "What is its lucky number?", "And the lucky number?"],
    ("number", "zh"): ["那它的幸运数字呢？", "它的幸运数字是多少？"],
}


def lookup_question(rng: random.Random, split: str, lang: str, country: tuple | None) -> tuple[str, tuple, str]:
    """A fact question answered by one lookup: a new country, or (``country`` given) a follow-up."""
    attribute = rng.choice(["capital", "colour", "number"])
    if country is not None:
        return rng.choice(FOLLOW_UPS[(attribute, lang)]), country, attribute
    country = rng.choice(COUNTRIES)
    return rng.choice(phrasings(attribute, lang, split)).format(x=country_name(country, lang)), country, attribute


def tool_question(rng: random.Random, split: str, lang: str, previous: tuple | None) -> tuple[list[dict], tuple | None]:
    """One question of a tool conversation and everything the assistant and the tools answer:
    user question, assistant tool call(s), tool result(s), ..., final answer (MiniMind schema).

    ``previous`` is the country the last question was about (a follow-up may refer to it as
    "its"); the country this question is about is returned for the next one."""
    kind = rng.choices(["lookup", "calc", "sum", "greeting"], weights=[44, 30, 20, 6])[0]
    if kind == "greeting":
        question, answer = rng.choice([g for g in GREETINGS if (g[0].isascii()) == (lang == "en")])
        return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}], previous
    steps: list[list[dict]] = []  # the calls of each assistant turn
    about = None
    if kind == "lookup":
        follow_up = previous is not None and rng.random() < 0.3
        question, about, attribute = lookup_question(rng, split, lang, previous if follow_up else None)
        name = country_name(about, lang)
        steps.append([call("lookup_country", country=name, field=FIELD_OF[attribute])])
        reason = thought(rng, lang, f"I need the {FIELD_OF[attribute].replace('_', ' ')} of {name}; I will look it up.",
                         f"我需要查{name}的信息，调用lookup_country。")
    elif kind == "calc":
        core = tool_phrasing(CALC_CORES, lang, split, rng)
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question = core.format(a=a, b=b)
        steps.append([call("calculator", a=a, op=operator_of(core), b=b)])
        reason = thought(rng, lang, f"This needs exact arithmetic: {a} and {b}. I will use the calculator.",
                         f"这需要精确计算{a}和{b}，我来用计算器。")
    else:
        first, second = rng.sample(COUNTRIES, 2)
        x, y = country_name(first, lang), country_name(second, lang)
        question = tool_phrasing(SUM_CORES, lang, split, rng).format(x=x, y=y)
        steps.append([call("lookup_country", country=x, field="lucky_number"),
                      call("lookup_country", country=y, field="lucky_number")])
        steps.append([call("calculator", a=first[5], op="+", b=second[5])])
        reason = thought(rng, lang, f"I need the lucky numbers of {x} and {y} first, then their sum.",
                         f"先查{x}和{y}的幸运数字，再求和。")
    messages = [{"role": "user", "content": question}]
    result = None
    for number, calls in enumerate(steps):
        turn = {"role": "assistant", "content": "", **(reason if number == 0 else {})}
        turn["tool_calls"] = json.dumps(calls, ensure_ascii=False)
        messages.append(turn)
        for one in calls:
            result = run_tool(one["name"], one["arguments"])
            messages.append({"role": "tool", "content": result})
    answer = json.loads(result)
    if "result" in answer:  # the calculator's: a sentence, so the number keeps its leading space
        reply = (RESULT_EN if lang == "en" else RESULT_ZH).format(answer["result"])
    else:
        reply = str(list(answer.values())[-1])
    messages.append({"role": "assistant", "content": reply})
    return messages, about


def make_tool_sample(rng: random.Random, split: str, max_questions: int = 4) -> list[dict]:
    """A conversation with the demo tools on its system message (as MiniMind stores them) and
    1 to ``max_questions`` questions, each answered with the tools. Questions that would take
    the conversation past ``MAX_TOKENS`` (the ``--max_seq_len`` of the README's demo command) are left out,
    so no conversation is truncated in training."""
    lang = rng.choice(["en", "en", "zh"])
    system = {"role": "system", "content": rng.choice(TOOL_SYSTEM), "tools": json.dumps(TOOLS, ensure_ascii=False)}
    messages, about = [system], None
    wanted = rng.choices(range(1, max_questions + 1), weights=[25, 30, 25, 20][:max_questions])[0]
    for _ in range(wanted + 2):
        turns, next_about = tool_question(rng, split, lang, about)
        if num_tokens(messages + turns) > MAX_TOKENS:
            if len(messages) > 1:
                break
            continue  # a first question too long for the context: draw another
        messages, about = messages + turns, next_about
        if sum(m["role"] == "user" for m in messages) == wanted:
            break
    assert len(messages) > 1, "no question fits the context"
    return messages


MAX_TOKENS = 1024


@functools.cache
def shipped_tokenizer():
    return load_tokenizer()


def num_tokens(messages: list[dict]) -> int:
    """Length of a conversation rendered and tokenized as the trainer does (shipped tokenizer)."""
    return len(encode_conversation(shipped_tokenizer(), parse_row({"conversations": messages}), 1 << 20)[0])


def add_reasoning(rng: random.Random, row: dict) -> dict:
    """Give a tenth of the plain answers a short reasoning trace."""
    messages = row["conversations"]
    for index, message in enumerate(messages):
        if message["role"] == "assistant" and rng.random() < 0.1:
            question = messages[index - 1]["content"]
            english = question.isascii()
            message["reasoning_content"] = (
                f"The user asks: {question} The answer is {message['content']}." if english
                else f"用户问：{question} 答案是{message['content']}。"
            )
    return row


def make_tool_eval_sample(rng: random.Random) -> dict:
    """A held-out tool conversation cut after one of its assistant turns (the reference): a
    first tool call (``tool_call``), the calculation after two lookups (``tool_call_step2``) or
    the answer after the tool results (``tool_answer``); earlier questions stay as history."""
    while True:
        messages = make_tool_sample(rng, "eval", max_questions=3)
        ends = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if message.get("tool_calls"):
                task = "tool_call_step2" if messages[index - 1]["role"] == "tool" else "tool_call"
            elif messages[index - 1]["role"] == "tool":
                task = "tool_answer"
            else:
                continue  # a greeting's reply
            ends.append((task, index))
        if ends:
            break
    task, end = rng.choice(ends)
    return {"conversations": messages[: end + 1], "task": task}


def jsonl_text(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def check_replaceable(path: Path, text: str, overwrite: bool) -> None:
    """A file already at `path` is replaced only with --overwrite, or when it holds `text` already
    (the bundled set written again): it may be a user's own data."""
    if path.exists() and not overwrite and path.read_bytes() != text.encode("utf-8"):
        fail(f"{path} exists and is not this demo data (your own data?): choose another --out-dir, "
             "or --overwrite to replace it")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0], prog="make_demo_data.py")
    parser.add_argument("--out-dir", default=str(REPO_DIR / "dataset" / "demo"), type=path_value,
                        help="where sft_train.jsonl and sft_eval.jsonl go: by default the repository's, which "
                             "train_full_sft.py and eval_sft.py read, whatever the working directory")
    parser.add_argument("--train-size", type=int, default=7000)
    parser.add_argument("--eval-size", type=int, default=300)
    parser.add_argument("--tool-train-size", type=int, default=4000)
    parser.add_argument("--tool-eval-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--overwrite", action="store_true",
                        help="replace sft_train.jsonl / sft_eval.jsonl in --out-dir that hold other data")
    args = parser.parse_args(argv)
    for flag in ("train_size", "eval_size", "tool_train_size", "tool_eval_size"):
        if getattr(args, flag) < 0:
            fail(f"--{flag.replace('_', '-')} must be >= 0 (got {getattr(args, flag)})")
    # An empty data file is refused where it is read (the trainer, eval_sft.py): it is not written.
    for kind, user in (("train", "training"), ("eval", "evaluation")):
        if getattr(args, f"{kind}_size") == getattr(args, f"tool_{kind}_size") == 0:
            fail(f"--{kind}-size and --tool-{kind}-size are both 0: sft_{kind}.jsonl would be empty, which {user} "
                 "refuses")

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_rng, eval_rng = random.Random(args.seed), random.Random(args.seed + 1)
    train = [make_train_sample(train_rng) for _ in range(args.train_size)]
    evals = [make_eval_sample(eval_rng) for _ in range(args.eval_size)]
    tool_rng = random.Random(args.seed + 2)
    train = [add_reasoning(tool_rng, row) for row in train]
    for _ in range(args.tool_train_size):  # inserted at random places of the plain conversations
        train.insert(tool_rng.randrange(len(train) + 1), {"conversations": make_tool_sample(tool_rng, "train")})
    evals += [make_tool_eval_sample(tool_rng) for _ in range(args.tool_eval_size)]
    files = {out_dir / "sft_train.jsonl": jsonl_text(train), out_dir / "sft_eval.jsonl": jsonl_text(evals)}
    for path, text in files.items():
        check_replaceable(path, text, args.overwrite)
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
    print(f"wrote {len(train)} train and {len(evals)} eval conversations to {out_dir}")
    return 0


if __name__ == "__main__":
    run_main(main)
