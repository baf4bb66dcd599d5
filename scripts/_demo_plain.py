"""The plain conversations of the demo set (scripts/make_demo_data.py): facts about the fictional
countries, sums, upper-casing and list reversal, greetings, in English and Chinese; the question
phrasings, a quarter of which are held out for the eval split, and the system prompts."""

from __future__ import annotations

import random

from dataset.demo_tools import COUNTRIES, country_fact

UPPERCASE_WORDS = [
    "apple", "river", "stone", "cloud", "tiger", "lemon",
    "piano", "candle", "garden", "rocket", "silver", "window",
]
LIST_LETTERS = "abcdef"

# A question is PREFIX + CORE. A (prefix, core) combination is either a train phrasing or an
# eval phrasing (see `is_eval_phrasing`), so every eval question uses a phrasing never seen in
# train, made of a prefix and a core that train does use (with other partners).
PREFIXES = {
    "en": ["", "Quick question: ", "Please answer: ", "I have a question. ", "Hi! "],
    "zh": ["", "问一下：", "请回答：", "我有个问题。", "你好！"],
}
# Placeholders: {x} country name, {a} {b} numbers, {w} word, {l} comma-separated list.
CORES = {
    ("capital", "en"): [
        "What is the capital of {x}?",
        "Which city is the capital of {x}?",
        "Tell me the capital of {x}.",
        "Name the capital city of {x}.",
        "{x} has which city as its capital?",
        "Capital of {x}?",
    ],
    ("capital", "zh"): ["{x}的首都是哪里？", "{x}的首都是什么？", "请告诉我{x}的首都。", "哪座城市是{x}的首都？", "{x}首都叫什么？"],
    ("colour", "en"): [
        "What colour is the flag of {x}?",
        "What is the flag colour of {x}?",
        "Tell me the colour of the flag of {x}.",
        "Which colour does the flag of {x} have?",
        "The flag of {x} is which colour?",
        "Flag colour of {x}?",
    ],
    ("colour", "zh"): ["{x}的国旗是什么颜色？", "{x}国旗的颜色是什么？", "请告诉我{x}国旗的颜色。", "{x}的国旗是哪种颜色？", "{x}国旗啥颜色？"],
    ("number", "en"): [
        "What is the lucky number of {x}?",
        "Tell me the lucky number of {x}.",
        "Which number is the lucky number of {x}?",
        "What lucky number does {x} have?",
        "Give the lucky number of {x}.",
        "Lucky number of {x}?",
    ],
    ("number", "zh"): ["{x}的幸运数字是多少？", "{x}的幸运数字是什么？", "请告诉我{x}的幸运数字。", "哪个数字是{x}的幸运数字？", "{x}幸运数字是几？"],
    ("add", "en"): ["What is {a} plus {b}?", "Compute {a} + {b}.", "Add {a} and {b}.", "{a} + {b} = ?", "Sum of {a} and {b}?"],
    ("add", "zh"): ["{a}加{b}等于多少？", "计算{a} + {b}。", "请算一下{a}加{b}。", "{a}和{b}的和是多少？"],
    ("upper", "en"): ["Uppercase the word: {w}", "Write {w} in capital letters.", "Convert {w} to uppercase.", "Make {w} all caps."],
    ("upper", "zh"): ["把单词{w}转换成大写。", "请把{w}写成大写字母。", "{w}的大写形式是什么？"],
    ("reverse", "en"): ["Reverse the list: {l}", "Write the list {l} backwards.", "What is {l} in reverse order?"],
    ("reverse", "zh"): ["把列表{l}倒过来。", "请反转列表：{l}", "{l}反过来是什么？"],
}


def is_eval_phrasing(prefix_index: int, core_index: int) -> bool:
    """About a quarter of the (prefix, core) combinations are held out for eval."""
    return (prefix_index + core_index) % 4 == 1


def phrasings(task: str, lang: str, split: str) -> list[str]:
    """All question templates of a task/language for ``split`` ("train" or "eval")."""
    want_eval = split == "eval"
    return [
        prefix + core
        for i, prefix in enumerate(PREFIXES[lang])
        for j, core in enumerate(CORES[(task, lang)])
        if is_eval_phrasing(i, j) == want_eval
    ]


GREETINGS = [
    ("Hello!", "Hello! How can I help you?"),
    ("Hi there.", "Hello! How can I help you?"),
    ("Who are you?", "I am MiniMind, a small assistant."),
    ("Thank you!", "You are welcome."),
    ("你好！", "你好！有什么可以帮你？"),
    ("你是谁？", "我是MiniMind，一个小助手。"),
    ("谢谢！", "不客气。"),
]

SHORT_SYSTEM = [
    "You are a helpful assistant.",
    "You are MiniMind, a small and friendly assistant.",
    "Answer briefly.",
    "你是一个乐于助人的助手。",
    "请简短回答。",
]
LONG_SYSTEM = [
    "You are MiniMind, a compact assistant trained for a demo. You know a small atlas of "
    "fictional countries: for each one you can give its capital, the colour of its flag and its "
    "lucky number. You can also add two small numbers, write a word in capital letters and "
    "reverse a short list. Always answer with the shortest exact answer, without extra words, "
    "and never invent facts that are not in your atlas.",
    "你是MiniMind，一个用于演示的小型助手。你了解一本虚构国家的地图集：对于每个国家，你都知道它的首都、"
    "国旗的颜色和幸运数字。你还会做个位数加法、把单词写成大写字母以及反转一个短列表。请始终给出最短、"
    "最准确的答案，不要添加多余的话。",
    "System notice: this conversation is part of an evaluation of short factual answers. The "
    "user may ask in English or in Chinese. Reply in the language of the question. Keep every "
    "reply to a single word, number or list. Do not apologise, do not explain your reasoning "
    "and do not repeat the question. If the user greets you, greet them back politely.",
]


FIELD_OF = {"capital": "capital", "colour": "flag_colour", "number": "lucky_number"}


def fact_answer(country: tuple, attribute: str, lang: str) -> str:
    """Exact answer for one (country, attribute, language)."""
    return str(country_fact(country, FIELD_OF[attribute], lang))


def country_name(country: tuple, lang: str) -> str:
    return country[0] if lang == "en" else country[1]


def fact_note(country: tuple, lang: str) -> str:
    """One-sentence summary of a country, used in reference-notes system prompts."""
    name = country_name(country, lang)
    cap, colour, number = (fact_answer(country, a, lang) for a in ("capital", "colour", "number"))
    if lang == "en":
        return f"{name}: capital {cap}, flag {colour}, lucky number {number}."
    return f"{name}：首都{cap}，国旗{colour}，幸运数字{number}。"


def reversed_list(letters: list[str]) -> str:
    return ", ".join(reversed(letters))


def make_qa(rng: random.Random, split: str, lang: str | None = None) -> tuple[str, str, str]:
    """Draw one (task, question, answer) with a phrasing of ``split`` ("train" or "eval")."""
    lang = lang or rng.choice(["en", "en", "zh"])
    kind = rng.choices(["fact", "add", "upper", "reverse"], weights=[72, 14, 9, 5])[0]
    if kind == "fact":
        country = rng.choice(COUNTRIES)
        attribute = rng.choice(["capital", "colour", "number"])
        template = rng.choice(phrasings(attribute, lang, split))
        return f"fact_{attribute}", template.format(x=country_name(country, lang)), fact_answer(country, attribute, lang)
    template = rng.choice(phrasings(kind, lang, split))
    if kind == "add":
        a, b = rng.randint(1, 5), rng.randint(1, 5)
        return "add", template.format(a=a, b=b), str(a + b)
    if kind == "upper":
        word = rng.choice(UPPERCASE_WORDS)
        return "upper", template.format(w=word), word.upper()
    letters = rng.sample(LIST_LETTERS, 3)
    return "reverse", template.format(l=", ".join(letters)), reversed_list(letters)


def make_system_prompt(rng: random.Random) -> str | None:
    """None (most samples), a short, a long, or a reference-notes system prompt."""
    kind = rng.choices(["none", "short", "long", "notes"], weights=[55, 25, 12, 8])[0]
    if kind == "none":
        return None
    if kind == "short":
        return rng.choice(SHORT_SYSTEM)
    if kind == "long":
        return rng.choice(LONG_SYSTEM)
    lang = rng.choice(["en", "zh"])
    countries = rng.sample(COUNTRIES, rng.randint(3, 8))
    header = "Reference notes:" if lang == "en" else "参考资料："
    return "\n".join([header] + [fact_note(c, lang) for c in countries])


def make_train_sample(rng: random.Random) -> dict:
    """One training conversation: optional system prompt, then 1-5 question/answer turns."""
    messages = []
    system = make_system_prompt(rng)
    if system is not None:
        messages.append({"role": "system", "content": system})
    num_turns = rng.choices([1, 2, 3, 4, 5], weights=[50, 20, 14, 10, 6])[0]
    for _ in range(num_turns):
        if rng.random() < 0.06:
            question, answer = rng.choice(GREETINGS)
        else:
            _, question, answer = make_qa(rng, "train")
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    return {"conversations": messages}


def make_eval_sample(rng: random.Random) -> dict:
    """One eval question with an unseen phrasing; the last message is the reference answer."""
    task, question, answer = make_qa(rng, "eval")
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"conversations": messages, "task": task}
