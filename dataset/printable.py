"""Data text for a terminal: its control characters escaped, so that a view shows what the data
holds and the data cannot steer the terminal (a ``\\r`` redraws the line, ``\\x1b[`` starts an
escape sequence, ``\\x07`` rings the bell).

Newlines and tabs stay (the views lay text out with them); every other C0 control, DEL and the C1
controls are written as Python writes them in a string literal (``\\r``, ``\\x1b``, ``\\x07``).
"""

from __future__ import annotations

_KEPT = "\n\t"
_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0)) if chr(code) not in _KEPT}
_ESCAPES[ord("\r")] = "\\r"


def printable(text: str) -> str:
    """``text`` with its control characters (but newlines and tabs) escaped."""
    return text.translate(_ESCAPES)
