"""The documentation stays true, and no half-done merge is committed."""

import os
import subprocess

import pytest

from trainer.args import flags_markdown

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Built from pieces so that this file does not itself hold a line that looks like a marker.
CONFLICT_START, CONFLICT_MIDDLE, CONFLICT_END = "<" * 7 + " ", "=" * 7, ">" * 7 + " "


def read(name: str) -> str:
    with open(os.path.join(REPO, name), encoding="utf-8") as handle:
        return handle.read()


def test_flags_doc_is_what_the_parser_generates():
    assert read("docs/flags.md") == flags_markdown(), (
        "docs/flags.md is not what trainer/args.py's parser gives now: run python scripts/write_flags_doc.py")


def tracked_files() -> list[str]:
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    return [name for name in listing.stdout.decode("utf-8").split("\0") if name]


def conflict_marker_lines(text: str) -> list[int]:
    """Line numbers (from 1) of merge-conflict markers: a line starting with the start or end
    marker, and a separator alone on its line between them."""
    found, inside = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith(CONFLICT_START):
            found.append(number)
            inside = True
        elif line.startswith(CONFLICT_END):
            found.append(number)
            inside = False
        elif inside and line == CONFLICT_MIDDLE:
            found.append(number)
    return found


def test_conflict_marker_lines_are_found():
    text = "\n".join(["a", CONFLICT_START + "HEAD", "b", CONFLICT_MIDDLE, "c", CONFLICT_END + "main", CONFLICT_MIDDLE])
    assert conflict_marker_lines(text) == [2, 4, 6]  # a separator outside a block is a heading underline


def test_no_tracked_file_holds_merge_conflict_markers():
    bad = []
    for name in tracked_files():
        path = os.path.join(REPO, name)
        if not os.path.isfile(path):
            continue  # deleted in the work tree, or a submodule
        with open(path, "rb") as handle:
            data = handle.read()
        if b"\0" in data:
            continue  # binary
        lines = conflict_marker_lines(data.decode("utf-8", errors="replace"))
        if lines:
            bad.append(f"{name} (line {', '.join(map(str, lines))})")
    assert not bad, f"merge-conflict markers committed in: {'; '.join(bad)}"
