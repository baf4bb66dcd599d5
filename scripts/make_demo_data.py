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

The eval split asks about the same facts / sums / words as the train split, but only with
question phrasings that never occur in train: a question is a prefix ("Quick question: ", …)
plus a core sentence, and about a quarter of the (prefix, core) combinations are held out. Each eval line is a single question whose last
message is the exact reference answer, plus a ``task`` key for per-task accuracy.

Usage: python scripts/make_demo_data.py [--out-dir dataset/demo] [--train-size 12000] [--eval-size 300]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# (English name, Chinese name, English capital, Chinese capital, colour index, lucky number)
COUNTRIES = [
    ("Zorlia", "佐利亚", "Velm", "维尔姆", 0, 17),
    ("Quendor", "昆多尔", "Ostra", "奥斯特拉", 1, 42),
    ("Marvonia", "马沃尼亚", "Tessel", "泰塞尔", 2, 8),
    ("Brindle", "布林德尔", "Kavo", "卡沃", 3, 63),
    ("Elsmere", "埃尔斯米尔", "Dunmar", "邓马尔", 4, 25),
    ("Farrowind", "法罗温德", "Lisk", "利斯克", 5, 91),
    ("Gallore", "加洛尔", "Pennick", "彭尼克", 6, 36),
    ("Hestavia", "赫斯塔维亚", "Roan", "罗安", 7, 54),
    ("Ithren", "伊斯伦", "Calder", "卡尔德", 1, 12),
    ("Jovania", "约瓦尼亚", "Mirren", "米伦", 3, 77),
    ("Kestrel", "凯斯特尔", "Yarrow", "亚罗", 5, 29),
    ("Lumbria", "伦布里亚", "Sable", "萨布尔", 0, 48),
    ("Norvale", "诺瓦尔", "Fenwick", "芬威克", 2, 83),
    ("Orinth", "奥林斯", "Gladd", "格拉德", 4, 5),
    ("Pellaro", "佩拉罗", "Tamsin", "塔姆辛", 6, 66),
    ("Rivenna", "里文娜", "Hollis", "霍利斯", 7, 31),
]
COLOURS_EN = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black"]
COLOURS_ZH = ["红色", "蓝色", "绿色", "黄色", "紫色", "橙色", "白色", "黑色"]

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


def fact_answer(country: tuple, attribute: str, lang: str) -> str:
    """Exact answer for one (country, attribute, language)."""
    _, _, cap_en, cap_zh, colour, number = country
    if attribute == "capital":
        return cap_en if lang == "en" else cap_zh
    if attribute == "colour":
        return COLOURS_EN[colour] if lang == "en" else COLOURS_ZH[colour]
    return str(number)


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


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="dataset/demo")
    parser.add_argument("--train-size", type=int, default=12000)
    parser.add_argument("--eval-size", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_rng, eval_rng = random.Random(args.seed), random.Random(args.seed + 1)
    train = [make_train_sample(train_rng) for _ in range(args.train_size)]
    evals = [make_eval_sample(eval_rng) for _ in range(args.eval_size)]
    write_jsonl(out_dir / "sft_train.jsonl", train)
    write_jsonl(out_dir / "sft_eval.jsonl", evals)
    print(f"wrote {len(train)} train and {len(evals)} eval conversations to {out_dir}")


if __name__ == "__main__":
    main()
