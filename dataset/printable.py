"""Data text for a terminal: its control characters escaped, so that a view shows what the data
holds and the data cannot steer the terminal (a ``\\r`` redraws the line, ``\\x1b[`` starts an
escape sequence, ``\\x07`` rings the bell).

Newlines and tabs stay (the views lay text out with them); every other C0 control, DEL and the C1
controls are written as Python writes them in a string literal (``\\r``, ``\\x1b``, ``\\x07``).
A line that must stay one line (a script's ``error: ...``, scripts/_common.py) has its newlines
escaped too (``one_line``).

``print_escaped`` prints the lines of ours that name a user's files or quote their data (the
trainer's start lines, notes, cache progress and errors): a file called ``a\\rb.jsonl`` shows as
that, not as ``b.jsonl`` over the line's start. Those lines hold no control characters of their own
but newlines, so escaping a whole line escapes exactly the names and data in it.
"""

from __future__ import annotations

_KEPT = "\n\t"
_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0)) if chr(code) not in _KEPT}
_ESCAPES[ord("\r")] = "\\r"
_LINE_ESCAPES = {**_ESCAPES, ord("\n"): "\\n"}


def printable(text: str, one_line: bool = False) -> str:
    """``text`` with its control characters (but newlines and tabs) escaped; with ``one_line``, its
    newlines too, so that a file name holding one cannot split the line."""
    return text.translate(_LINE_ESCAPES if one_line else _ESCAPES)


def print_escaped(message: str, file=None) -> None:
    """Print ``message`` (a line of ours that may name files or quote data) escaped, and flush."""
    print(printable(message), file=file, flush=True)
