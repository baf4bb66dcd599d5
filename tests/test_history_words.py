"""Code and docs state what is and why, not how it came to be.

Scanned: the comments and docstrings of the code (`train_full_sft.py`, `trainer/`, `dataset/`,
`model/`, `scripts/`) and the docs (`README.md`, `docs/*.md`). `CHANGELOG.md` is history by design
and is not scanned; `docs/results.md`, the one table of dated measurements (date, machine, command,
figure), may hold dates and commit references and nothing else of the history below. The code's
other string literals (the messages a user reads) are checked for dates and issue and commit
references only: a message may say "no longer" or "used to" of the user's own files.

What counts as history (HISTORY below), chosen so that a hit is almost always history and a
sentence about the present almost never hits:
- a date (`2026-11-24`): what was measured when belongs in docs/results.md, and a format is named
  by its version;
- an issue or commit reference (`issue 14`, `(issue`, `main at af11f2e`, `commit 6be5eab`);
- words that narrate a change: "used to" (not the passive "is / are / be used to"), "until" a
  year, a day or "that day", "shipped until", "it / this / which replaced", "no longer",
  "previously", "formerly", "originally", "as of" a version or day, "today('s)", "is / are now",
  "now has / uses / renders / trains ..." (a change, unlike "stop now"), "2 now)", "an earlier /
  the old version / code / tokenizer / data ...", "earlier shipped", "this wave / fix", "before /
  after this change", "changes since", "one run in ten" (how often a bug struck before its fix).
Words left out because they are mostly about the present: "now" alone, "earlier" alone (an earlier
step, an earlier run of the build), "the old" alone (the old line of training), "before", "since".
"""

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODE = ("train_full_sft.py", "trainer", "dataset", "model", "scripts")
RESULTS = "docs/results.md"

DATE = r"\b20\d\d-[01]\d-[0-3]\d\b"
ISSUE = r"\bissues?\s+#?\d+|\(issue\b"
COMMIT = r"\b(?:main|commit|code)\s+(?:at|of)\s+[0-9a-f]{7,40}\b|\bcommit\s+[0-9a-f]{7,40}\b"
REFERENCE = f"{ISSUE}|{COMMIT}"
WORDS = "|".join([
    r"(?<!\bbe\s)(?<!\bis\s)(?<!\bare\s)(?<!\bbeen\s)\bused\s+to\b",
    r"\buntil\s+(?:(?:19|20)\d\d|that\s+day|today|yesterday|recently)\b",
    r"\bshipped\s+until\b",
    r"\b(?:it|this|which)\s+replaced\b",
    r"\bno\s+longer\b",
    r"\b(?:previously|formerly|originally|nowadays|historically)\b",
    r"\bas\s+of\s+(?:today|now|this|version|v\d|(?:19|20)\d\d)\b",
    r"\btoday(?:'s)?\b",
    r"\b(?:is|are)\s+now\b",
    r"\bnow\s+(?:has|have|uses|renders|trains|counts|streams?|writes|reads|takes|keeps|builds|runs|gives|does)\b",
    r"\b\d+\s+now\)",
    r"\b(?:an?|the)\s+(?:earlier|old)\s+(?:version|code|tokenizer|release|main|default|behaviou?r|format|data|"
    r"command|form|line\s+said)\b",
    r"\bearlier\s+shipped\b",
    r"\bthis\s+(?:wave|fix)\b",
    r"\b(?:before|after)\s+this\s+change\b",
    r"\bchanges\s+since\b",
    r"\bone\s+(?:run|time)\s+in\s+(?:\d+|two|three|four|five|ten|twenty|a\s+hundred)\b",
])
HISTORY = re.compile(f"{DATE}|{REFERENCE}|{WORDS}", re.IGNORECASE)
DATE_OR_REFERENCE = re.compile(f"{DATE}|{REFERENCE}", re.IGNORECASE)
IN_RESULTS = re.compile(f"{ISSUE}|{WORDS}", re.IGNORECASE)  # a measurement may name the commit it ran at


def hits(pattern: re.Pattern, text: str, first_line: int = 1) -> list[tuple[int, str]]:
    return [(first_line + text[:match.start()].count("\n"), " ".join(match.group().split()))
            for match in pattern.finditer(text)]


def prose_of(source: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(comments and docstrings, other string literals) of Python source, each as (first line, text);
    comments on consecutive lines form one piece, so a phrase broken across them is still found."""
    tree = ast.parse(source)
    docstrings = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings[id(first.value)] = (first.value.lineno, first.value.value)
    literals = [(node.lineno, node.value) for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]
    prose, run_line, run, last = list(docstrings.values()), 0, [], -1
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        if line != last + 1 and run:
            prose.append((run_line, "\n".join(run)))
            run = []
        if not run:
            run_line = line
        run.append(token.string.lstrip("#").strip())
        last = line
    if run:
        prose.append((run_line, "\n".join(run)))
    return prose, literals


def code_files() -> list[Path]:
    return sorted(path for root in CODE for path in
                  ([REPO / root] if root.endswith(".py") else (REPO / root).rglob("*.py")))


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def report(found: list[str]) -> str:
    return f"{len(found)} place(s) tell how something came to be (say what is; dated figures go to {RESULTS}):\n" \
        + "\n".join(found)


def test_the_patterns_find_history_and_leave_the_present_alone():
    history = ["the tokenizer shipped until 2026-11-24", "# Batching (issue 6)", "see issue 14", "main at af11f2e",
               "the build used to tokenize the whole text", "It replaced the inf-norm", "packed rows no longer build",
               "today's tokenizer", "the command until 2026-11-24", "until that day", "The build now renders",
               "TOKENS_VERSION, 2 now)", "with an earlier version of the script", "the old code logged",
               "the code this wave started from", "Changes since runs 0 to 2", "commit\n6be5eab", "previously",
               "one run in ten of the test hung"]
    present = ["may be used to run code", "stop now", "a resume to an earlier step", "the old line of training",
               "kept until the process ends", "progress.json replaced atomically", "the rows before were tokenized",
               "since the last checkpoint", "sha256 4e2daa391d9bdc6c", "continues until it answers in text",
               "the cache now exists", "the run that made this commit", "an earlier, interrupted build",
               "the old one once no older minisft uses it"]
    assert [text for text in history if not HISTORY.search(text)] == []
    assert [text for text in present if HISTORY.search(text)] == []


def test_comments_and_docstrings_of_the_code_tell_no_history():
    found = []
    for path in code_files():
        prose, literals = prose_of(path.read_text(encoding="utf-8"))
        name = path.relative_to(REPO)
        found += [f"{name}:{line}: {word}" for start, text in prose for line, word in hits(HISTORY, text, start)]
        found += [f"{name}:{line}: {word}" for start, text in literals
                  for line, word in hits(DATE_OR_REFERENCE, text, start)]
    assert not found, report(found)


def test_the_docs_tell_no_history_and_only_the_results_table_holds_dates():
    found = []
    for path in doc_files():
        name = path.relative_to(REPO).as_posix()
        pattern = IN_RESULTS if name == RESULTS else HISTORY
        found += [f"{name}:{line}: {word}" for line, word in hits(pattern, path.read_text(encoding="utf-8"))]
    assert not found, report(found)


def test_every_row_of_the_results_table_has_its_date_machine_command_and_figure():
    rows = [line for line in (REPO / RESULTS).read_text(encoding="utf-8").splitlines() if line.startswith("| ")]
    header, body = rows[0], [row for row in rows[1:] if not set(row) <= set("|-: ")]
    assert [cell.strip() for cell in header.strip("|").split("|")][:4] == ["Date", "Machine", "Command", "Figure"]
    bad = []
    for row in body:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if not (len(cells) >= 4 and re.fullmatch(DATE, cells[0]) and all(cells[1:4])):
            bad.append(row)
    assert body and not bad, f"rows of {RESULTS} without a date, machine, command or figure: {bad}"


def test_the_readme_links_the_changelog_and_the_results_table():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "](CHANGELOG.md)" in readme, "README.md does not link CHANGELOG.md"
    assert f"]({RESULTS})" in readme, f"README.md does not link {RESULTS}"
