"""The demo's world and tools: a table of fictional countries, a lookup tool and a calculator.

``scripts/make_demo_data.py`` writes tool-calling conversations with these tools, and
``scripts/chat.py --tools demo`` answers a model's tool calls by running them (``run_tool``).
"""

from __future__ import annotations

import json
import operator

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
FIELDS = ("capital", "flag_colour", "lucky_number")
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_country",
            "description": "Look up a fact about a country.",
            "parameters": {
                "type": "object",
                "properties": {"country": {"type": "string"}, "field": {"type": "string", "enum": list(FIELDS)}},
                "required": ["country", "field"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Compute a op b.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "op": {"type": "string", "enum": list(OPERATORS)},
                               "b": {"type": "number"}},
                "required": ["a", "op", "b"],
            },
        },
    },
]


def country_fact(country: tuple, field: str, lang: str) -> str | int:
    """The value of ``field`` for ``country`` in English (``en``) or Chinese (``zh``); the lucky
    number as a number."""
    _, _, capital_en, capital_zh, colour, number = country
    if field == "capital":
        return capital_en if lang == "en" else capital_zh
    if field == "flag_colour":
        return COLOURS_EN[colour] if lang == "en" else COLOURS_ZH[colour]
    return number


def lookup_country(country: str, field: str) -> dict:
    """The tool: ``{"country": name, field: value}`` (in the language of the name) or an error."""
    for row in COUNTRIES:
        if country in (row[0], row[1]):
            if field not in FIELDS:
                return {"error": f"unknown field {field!r}; use one of {', '.join(FIELDS)}"}
            return {"country": country, field: country_fact(row, field, "en" if country == row[0] else "zh")}
    return {"error": f"unknown country {country!r}"}


def calculate(a, op: str, b) -> dict:
    """The tool: ``{"result": number}`` for ``a op b`` (op one of + - * /), or an error (also for a
    result too large for JSON).

    Numbers travel as JSON numbers everywhere (arguments, lookup values, results), so a number
    keeps its tokens, with its leading space, from the question to the call, from a result to
    the next call and from the result to the answer ("The result is 444.")."""
    for name, value in (("a", a), ("b", b)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return {"error": f"{name} must be a number, got {value!r}"}
        if isinstance(value, float) and (value != value or abs(value) == float("inf")):
            return {"error": f"{name} must be a finite number, got {value!r}"}
    if op not in OPERATORS:
        return {"error": f"unknown op {op!r}; use one of {' '.join(OPERATORS)}"}
    if op == "/" and b == 0:
        return {"error": "division by zero"}
    try:
        result = OPERATORS[op](a, b)
    except OverflowError:  # an int too large for a float, mixed with one or divided
        return {"error": "the result is too large"}
    # JSON has no infinity, and Python writes no integer of more than 4300 digits
    too_large = abs(result) == float("inf") if isinstance(result, float) else result.bit_length() > 13_000
    if too_large:
        return {"error": "the result is too large"}
    if isinstance(result, float):
        result = int(result) if result.is_integer() else round(result, 6)
    return {"result": result}


def run_tool(name: str, arguments: dict) -> str:
    """Run one demo tool call; the result as the JSON text of a tool message."""
    try:
        if name == "lookup_country":
            result = lookup_country(**arguments)
        elif name == "calculator":
            result = calculate(**arguments)
        else:
            result = {"error": f"unknown tool {name!r}"}
    except TypeError as exc:  # missing or unexpected arguments
        result = {"error": f"bad arguments for {name}: {exc}"}
    return json.dumps(result, ensure_ascii=False)
