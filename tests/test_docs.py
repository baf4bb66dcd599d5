"""The documentation stays true, and no half-done merge is committed."""

import glob
import os
import re
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


# A name in the README's layout tables: a file or folder inside the folder of its row.
LAYOUT_NAME = re.compile(r"^\w[\w.-]*(\.py|\.md|/)$")


def layout_paths(readme: str) -> list[str]:
    """Every path the README's Layout section names. In each table the first column holds a path
    (inside the folder named in the table's header, if any); a folder's row names files and
    folders inside it in backquotes."""
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    paths, base, in_table = [], "", False
    for line in section.splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[0])
        if not in_table:  # the header row
            in_table = True
            base = names[0] if names and names[0].endswith("/") else ""
            continue
        if set(cells[0]) <= set("-: "):
            continue
        for name in names:
            path = base + name
            paths.append(path)
            if path.endswith("/") and len(cells) > 1:
                paths += [path + inner for inner in re.findall(r"`([^`]+)`", cells[1]) if LAYOUT_NAME.match(inner)]
    return paths


def test_every_path_in_the_readme_layout_exists():
    paths = layout_paths(read("README.md"))
    assert len(paths) >= 40 and "trainer/checkpoint/resume.py" in paths, paths  # the parser found the tables
    missing = [path for path in paths if not os.path.exists(os.path.join(REPO, path))]
    assert not missing, f"README.md's layout names paths that do not exist: {missing}"


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file."""
    anchors, seen, fenced = set(), {}, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_links_between_the_docs_point_at_files_and_headings_that_exist():
    broken = []
    for name in ["README.md"] + sorted(os.path.relpath(path, REPO) for path in glob.glob(os.path.join(REPO, "docs", "*.md"))):
        for target in re.findall(r"\]\(([^)\s]+)\)", read(name)):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            file_part, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(name), file_part)) if file_part else name
            if not os.path.exists(os.path.join(REPO, path)):
                broken.append(f"{name}: {target} (no such file)")
            elif anchor and path.endswith(".md") and anchor not in heading_anchors(read(path)):
                broken.append(f"{name}: {target} (no such heading)")
    assert not broken, "broken links: " + "; ".join(broken)


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


def test_the_reliability_page_counts_its_own_rows():
    text = open(os.path.join(REPO, "docs", "reliability.md"), encoding="utf-8").read()
    rows = [line for line in text.splitlines()
            if line.startswith("| ") and not re.match(r"\| (Fault|Case) \|", line)]
    stated = re.search(r"The tables below list (\d+) cases", text)
    assert stated and int(stated.group(1)) == len(rows), f"docs/reliability.md has {len(rows)} rows"
