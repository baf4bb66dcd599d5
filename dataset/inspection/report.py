"""What training data teaches, read the way training reads it: per source and per segment the
tokens and the supervised tokens, the rows training drops and why, and what looks wrong.

``inspect_source`` reads a source of ``--data_path`` (``mixture.Source``), all of it or rows
spread evenly over it, and segments every row (``segments.segment_row``: the same rendering,
tokens and loss mask as the token cache, cut at ``max_seq_len``). ``SourceReport`` adds them up:

* per segment (system, tools block, user, tool result, think block, reply, tool call,
  end-of-turn, template): the tokens training keeps, how many of them carry loss, and the tokens
  cut off by ``--max_seq_len`` (all tokens of a dropped row count as cut);
* rows kept, truncated (longer than ``max_seq_len``), dropped (no loss token left) by reason,
  with an example, and bad rows (that ``--bad_data error`` stops on);
* assistant turns that learn an empty think block (``<think>\\n\\n</think>``).

``SourceReport.warnings`` says what looks wrong; ``training_summary`` is the trainer's few start
lines (trainer/data_setup.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..formats import LineError, decode_line, parse_line
from ..mixture import Source
from ..sources import is_gzip, is_parquet, open_lines
from .segments import REPLY, SEGMENTS, THINK, TOOL_CALL, SegmentedRow, segment_row

WHOLE_FILE_BYTES = 64 << 20  # a source's plain files up to this size in all are read whole to pick rows, else sought
TRAINING_ROWS = 128  # rows the trainer's start summary reads, spread over the sources
MIN_TRAINING_ROWS = 16  # ... but at least this many per source
MOST = 0.5  # "most rows": the share of truncated rows that is warned about
CANDIDATES = 2000  # rows kept in memory to pick the samples shown from (and the first dropped row after them)


@dataclass
class Sample:
    """A row kept for display."""

    source: str
    location: str  # file:line
    row: SegmentedRow


@dataclass
class SourceReport:
    name: str
    spec: str
    files: int
    max_seq_len: int
    weight: float = 1.0
    rows: int = 0  # rows read (non-blank lines)
    total_rows: int | None = 0  # rows of the source when every file was read whole, else None
    bad: int = 0
    first_bad: str = ""
    kept: int = 0
    truncated: int = 0  # rows longer than max_seq_len, kept or dropped
    truncated_kept: int = 0  # kept rows longer than max_seq_len (their ends are not trained on)
    dropped: Counter = field(default_factory=Counter)  # reason -> rows
    drop_examples: dict = field(default_factory=dict)  # reason -> "file:line: detail"
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(len(SEGMENTS), dtype=np.int64))
    supervised: np.ndarray = field(default_factory=lambda: np.zeros(len(SEGMENTS), dtype=np.int64))
    cut: np.ndarray = field(default_factory=lambda: np.zeros(len(SEGMENTS), dtype=np.int64))
    assistant_turns: int = 0
    trained_turns: int = 0  # assistant turns with a loss token within max_seq_len, in kept rows
    empty_thinks: int = 0  # assistant turns whose empty think block carries loss
    empty_think_tokens: int = 0  # their supervised tokens
    samples: list[Sample] = field(default_factory=list)

    def add(self, location: str, row: SegmentedRow) -> None:
        reason = row.drop_reason()
        self.truncated += row.truncated
        if reason is None:
            self.kept += 1
            self.truncated_kept += row.truncated
            self.tokens += row.counts()
            self.supervised += row.counts(supervised_only=True)
            self.cut += row.counts(kept=False)
            self.trained_turns += row.trained_turns()
            blocks, tokens = row.supervised_empty_thinks()
            self.empty_thinks += blocks
            self.empty_think_tokens += tokens
        else:
            self.dropped[reason[0]] += 1
            self.drop_examples.setdefault(reason[0], f"{location}: {reason[1]}")
            self.cut += row.counts() + row.counts(kept=False)
        self.assistant_turns += row.assistant_turns

    @property
    def parsed(self) -> int:
        return self.rows - self.bad

    def sampled_text(self) -> str:
        whole = self.total_rows is not None and self.rows == self.total_rows
        return f"all {self.rows} rows" if whole else f"{self.rows} rows sampled" + (
            f" of {self.total_rows}" if self.total_rows else "")

    def drops_text(self) -> str:
        return "; ".join(f"{count} {reason}" for reason, count in self.dropped.most_common())

    def warnings(self, empty_thinks: bool = True, bad_data: str = "error") -> list[str]:
        """What looks wrong in this source, one line each (``empty_thinks``: with supervised empty think blocks;
        ``bad_data``: the run's ``--bad_data``, which decides what its bad rows do)."""
        found = []
        if self.parsed and not self.supervised.sum():
            found.append(f"{self.name}: no supervised token in {self.sampled_text()} (--max_seq_len "
                         f"{self.max_seq_len}): this source trains nothing ({self.drops_text() or 'every row dropped'})")
        elif self.dropped:
            dropped = sum(self.dropped.values())
            found.append(f"{self.name}: {dropped} of {self.parsed} rows dropped, no loss token left after truncation to "
                         f"--max_seq_len {self.max_seq_len}: {self.drops_text()}")
        for k in (THINK, REPLY, TOOL_CALL):  # a kind of turn truncation takes away entirely
            if self.cut[k] and not self.supervised[k] and self.supervised.sum():
                found.append(f"{self.name}: no {SEGMENTS[k]} is trained: all {self.cut[k]} {SEGMENTS[k]} tokens are cut by "
                             f"--max_seq_len {self.max_seq_len}")
        if self.kept and self.truncated_kept > MOST * self.kept:
            found.append(f"{self.name}: {self.truncated_kept} of the {self.kept} rows kept are longer than --max_seq_len "
                         f"{self.max_seq_len}; their ends are not trained on")
        if self.empty_thinks and empty_thinks:
            found.append(f"{self.name}: " + empty_think_warning([self]))
        if self.bad:
            effect = "--bad_data skip leaves out of training" if bad_data == "skip" else "stop training unless --bad_data skip"
            found.append(f"{self.name}: {self.bad} bad rows, which {effect} (first: {self.first_bad})")
        return found

    def to_json(self) -> dict:
        return {
            "name": self.name, "spec": self.spec, "files": self.files, "weight": self.weight, "max_seq_len": self.max_seq_len,
            "rows": self.rows, "total_rows": self.total_rows, "bad": self.bad, "kept": self.kept,
            "truncated": self.truncated, "dropped": dict(self.dropped), "drop_examples": dict(self.drop_examples),
            "assistant_turns": self.assistant_turns, "trained_assistant_turns": self.trained_turns,
            "supervised_empty_think_blocks": self.empty_thinks,
            "supervised_empty_think_tokens": self.empty_think_tokens,
            "segments": {name: {"tokens": int(self.tokens[k]), "supervised": int(self.supervised[k]),
                                "cut": int(self.cut[k])} for k, name in enumerate(SEGMENTS)},
            "warnings": self.warnings(),
        }


# --------------------------------------------------------------------------- reading rows


def sample_lines(path: Path, limit: int, whole_bytes: int | None = None) -> tuple[list[tuple[int | str, bytes]], int | None]:
    """(where, raw line) of up to ``limit`` non-blank rows spread evenly over a data file (every row
    for ``limit <= 0``), and the file's row count when it was read whole (else ``None``). ``where``
    is the line number (from 1, as the token cache counts); a plain file over ``whole_bytes``
    (default ``WHOLE_FILE_BYTES``) is sampled by seeking, and its rows are named by byte offset
    instead (``"byte N"``); a compressed or parquet file gives its first rows."""
    whole_bytes = WHOLE_FILE_BYTES if whole_bytes is None else whole_bytes
    if limit > 0 and not (is_gzip(path) or is_parquet(path)) and path.stat().st_size > whole_bytes:
        return _seek_lines(path, limit), None
    rows, total = [], 0
    for number, line in enumerate(open_lines(path), start=1):
        if line.strip():
            rows.append((number, line))
            total += 1
            if limit > 0 and (is_gzip(path) or is_parquet(path)) and total == limit:
                return rows, None
    if 0 < limit < len(rows):
        rows = [rows[k] for k in _spread(len(rows), limit)]
    return rows, total


def _spread(total: int, count: int) -> list[int]:
    """``count`` indices spread evenly over ``range(total)``, the first and (for count > 1) the last included."""
    if count >= total:
        return list(range(total))
    if count == 1:
        return [0]
    return sorted({round(k * (total - 1) / (count - 1)) for k in range(count)})


def _seek_lines(path: Path, limit: int) -> list[tuple[str, bytes]]:
    size, rows = path.stat().st_size, []
    with path.open("rb") as handle:
        for k in range(limit):
            handle.seek(size * k // limit)
            if k:
                handle.readline()  # the rest of the line the seek landed in
            start = handle.tell()
            line = handle.readline()
            while line and not line.strip():
                start, line = handle.tell(), handle.readline()
            if line and (not rows or rows[-1][0] != f"byte {start}"):
                rows.append((f"byte {start}", line))
    return rows


def inspect_source(source: Source, tokenizer, max_seq_len: int, rows: int = 0, samples: int = 0) -> SourceReport:
    """Read ``rows`` rows spread over the source's files (0: all) and add them up; keep ``samples``
    rows for display (``pick_samples``)."""
    report = SourceReport(source.name, source.spec, len(source.files), max_seq_len, source.weight)
    files = list(source.files)
    if rows > 0 and len(files) > rows:
        files = [files[k] for k in _spread(len(files), rows)]
    kept: list[Sample] = []
    for number, path in enumerate(files):
        quota = rows // len(files) + (number < rows % len(files)) if rows > 0 else 0
        lines, total = sample_lines(path, quota, WHOLE_FILE_BYTES // len(files))
        report.total_rows = None if total is None or report.total_rows is None else report.total_rows + total
        for where, raw in lines:
            location = f"{path}:{where}" if isinstance(where, int) else f"{path} ({where})"
            report.rows += 1
            try:
                row = segment_row(tokenizer, parse_line(decode_line(raw)), max_seq_len)
            except LineError as error:
                report.bad += 1
                report.first_bad = report.first_bad or f"{location}: {error}"
                continue
            report.add(location, row)
            if samples and (len(kept) < CANDIDATES or row.dropped and sum(report.dropped.values()) == 1):
                kept.append(Sample(source.name, location, row))
    if len(files) < len(source.files):
        report.total_rows = None
    report.samples = pick_samples(kept, samples)
    return report


def pick_samples(candidates: list[Sample], count: int) -> list[Sample]:
    """Up to ``count`` rows to show: a dropped row, a row calling tools and one with reasoning
    first (if there are such), then rows spread over the rest; in reading order."""
    if count <= 0:
        return []
    chosen: list[int] = []
    tests = (lambda row: row.dropped,
             lambda row: bool((row.segments[: row.kept][row.supervised[: row.kept]] == TOOL_CALL).any()),
             lambda row: row.thoughts > 0)
    for test in tests:
        found = next((k for k, sample in enumerate(candidates) if k not in chosen and test(sample.row)), None)
        if found is not None and len(chosen) < count:
            chosen.append(found)
    for k in _spread(len(candidates), count):
        if len(chosen) >= count:
            break
        if k not in chosen:
            chosen.append(k)
    for k in range(len(candidates)):
        if len(chosen) >= count:
            break
        if k not in chosen:
            chosen.append(k)
    return [candidates[k] for k in sorted(chosen)]


# --------------------------------------------------------------------------- text


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def segment_rows(reports: list[SourceReport]) -> list[tuple[str, int, int, str, int]]:
    """(segment, tokens, supervised, share of the supervised tokens, cut) of one or more sources
    (added up), for the segments that have tokens, then ``all``."""
    tokens = sum(report.tokens for report in reports)
    supervised = sum(report.supervised for report in reports)
    cut = sum(report.cut for report in reports)
    rows = [(name, int(tokens[k]), int(supervised[k]), percent(supervised[k], supervised.sum()), int(cut[k]))
            for k, name in enumerate(SEGMENTS) if tokens[k] or cut[k]]
    return rows + [("all", int(tokens.sum()), int(supervised.sum()), "", int(cut.sum()))]


def segment_table(reports: list[SourceReport]) -> list[str]:
    """The per-segment table of one or more sources (added up), as text lines."""
    lines = [f"  {'segment':<12} {'tokens':>9} {'supervised':>11} {'share of loss':>14} {'cut':>8}"]
    for name, tokens, supervised, share, cut in segment_rows(reports):
        lines.append(f"  {name:<12} {tokens:>9} {supervised:>11} {share:>14} {cut:>8}")
    return lines


def report_lines(report: SourceReport) -> list[str]:
    """A source's block of the inspection script's output."""
    lines = [f"source {report.name} ({report.spec}, {report.files} file(s), weight {report.weight:g}): "
             f"{report.sampled_text()}, --max_seq_len {report.max_seq_len}",
             f"  rows: {report.kept} kept, {sum(report.dropped.values())} dropped, {report.bad} bad; "
             f"{report.truncated} longer than --max_seq_len (cut)"]
    for reason, count in report.dropped.most_common():
        lines.append(f"  dropped {count}: {reason} (e.g. {report.drop_examples[reason]})")
    if report.bad:
        lines.append(f"  bad {report.bad}: first {report.first_bad}")
    lines.append(f"  assistant turns: {report.assistant_turns}, {report.trained_turns} trained (a loss token within "
                 f"--max_seq_len); {report.empty_thinks} learn an empty think block ({report.empty_think_tokens} "
                 "supervised tokens)")
    return lines + segment_table([report])


def empty_think_warning(reports: list[SourceReport]) -> str:
    blocks = sum(report.empty_thinks for report in reports)
    tokens = sum(report.empty_think_tokens for report in reports)
    share = percent(tokens, sum(int(report.supervised.sum()) for report in reports))
    return (f"{blocks} of {sum(report.trained_turns for report in reports)} trained assistant turns learn an empty think "
            f"block (<think>\\n\\n</think> supervised: {tokens} tokens, {share} of the loss tokens): the model learns to "
            "skip its reasoning; right for replies meant to be thinking-off, else give them reasoning or drop the empty "
            "blocks from most samples (--drop_empty_think_ratio 0.8, as MiniMind)")


def training_summary(sources: list[Source], tokenizer, max_seq_len: int, drop_empty_think: bool = False,
                     rows: int = TRAINING_ROWS, bad_data: str = "error") -> list[str]:
    """The trainer's start lines: supervised tokens per segment over ``rows`` rows spread over the
    sources (at least ``MIN_TRAINING_ROWS`` each), each source's rows dropped and why, and warnings
    (one for the supervised empty think blocks of all sources, unless ``drop_empty_think``; bad rows
    as ``bad_data``, the run's ``--bad_data``, treats them)."""
    rows = max(MIN_TRAINING_ROWS, rows // max(1, len(sources)))
    reports = [inspect_source(source, tokenizer, max_seq_len, rows) for source in sources]
    tokens = sum(report.tokens for report in reports)
    supervised = sum(report.supervised for report in reports)
    learned = ", ".join(f"{SEGMENTS[k]} {supervised[k]}" for k in range(len(SEGMENTS)) if supervised[k])
    prompt = ", ".join(f"{SEGMENTS[k]} {tokens[k] - supervised[k]}" for k in range(len(SEGMENTS))
                       if tokens[k] - supervised[k])
    lines = [f"[data] inspected up to {rows} rows per source (more: scripts/inspect_data.py): {supervised.sum()} of "
             f"{tokens.sum()} tokens supervised: {learned or 'none'}; not: {prompt or 'none'}"]
    for report in reports:
        lines.append(f"[data] {report.name}: {report.sampled_text()}: {report.kept} kept, "
                     f"{sum(report.dropped.values())} dropped" + (f" ({report.drops_text()})" if report.dropped else "")
                     + f", {report.truncated} cut to --max_seq_len")
    lines += [f"[data] warning: {warning}" for report in reports
              for warning in report.warnings(empty_thinks=False, bad_data=bad_data)]
    if not drop_empty_think and any(report.empty_thinks for report in reports):
        lines.append(f"[data] warning: {empty_think_warning(reports)}")
    return lines
