"""Pictures of conversations as training sees them: a self-contained HTML page and a coloured
terminal view (``scripts/inspect_data.py --html`` / ``--terminal``).

Both show every token of a row's rendering, in order, with the boundaries between tokens visible,
the supervised ones (those that carry loss) highlighted and the ones past ``--max_seq_len``
struck through. In the page every token is ``<span class="t seg-... [sup|cut]" title="token N ·
id I · segment · supervised">``; its text is the token's piece of the rendering
(``SegmentedRow.pieces``), so the spans' text joins back to the rendered conversation; the
segment is the token's underline colour (legend at the top) and, with the id, its tooltip.
"""

from __future__ import annotations

import html

from ..printable import printable
from .report import Sample, SourceReport, percent, segment_rows
from .segments import SEGMENTS

HIGHLIGHT = "#ffd84d"  # the supervised tokens' background (tests look for it in a screenshot)
LOST = "#fff1b8"  # a token that would carry loss but is cut by --max_seq_len
SEGMENT_COLOURS = ("#2e7d32", "#8d6e63", "#1565c0", "#00acc1", "#8e24aa", "#e53935", "#fb8c00", "#000000", "#bdbdbd")

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #1b1b1b; background: #fff; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin-top: 28px; } h3 { font-size: 14px; margin: 18px 0 4px; }
.meta, .facts { color: #555; margin: 2px 0; }
table { border-collapse: collapse; margin: 6px 0 14px; }
td, th { border: 1px solid #ddd; padding: 0 8px; text-align: right; font-size: 13px; }
td:first-child, th:first-child { text-align: left; }
.legend { margin: 8px 0; line-height: 2.0; }
.key { padding: 1px 6px; margin-right: 6px; border-bottom: 3px solid; white-space: nowrap; }
pre.tokens { white-space: pre-wrap; word-break: break-all; font: 13px/2.0 ui-monospace, Menlo, Consolas, monospace;
             background: #fafafa; border: 1px solid #e2e2e2; padding: 10px; margin: 4px 0 12px; }
.t { border-right: 1px solid #9e9e9e; border-bottom: 3px solid transparent; padding: 1px 0; }
.t:empty { display: inline-block; width: 3px; height: 1.1em; vertical-align: text-bottom; }
.sup { background: %(highlight)s; }
.cut { color: #9a9a9a; text-decoration: line-through; }
.lost { background: %(lost)s; }
.nl::before { content: "\\21B5"; color: #a0a0a0; }
.warn { color: #a03800; }
.source { display: flex; flex-wrap: wrap; gap: 8px 28px; align-items: flex-start; }
.about { flex: 1 1 360px; max-width: 560px; }
""" % {"highlight": HIGHLIGHT, "lost": LOST} + "".join(
    f".seg-{name.replace(' ', '-')} {{ border-bottom-color: {colour}; }}\n"
    for name, colour in zip(SEGMENTS, SEGMENT_COLOURS))


def segment_class(segment: int) -> str:
    return "seg-" + SEGMENTS[segment].replace(" ", "-")


def token_title(sample: Sample, index: int) -> str:
    row = sample.row
    state = "cut by --max_seq_len" if index >= row.kept else ("supervised" if row.supervised[index] else "not supervised")
    return f"token {index + 1} · id {int(row.ids[index])} · {SEGMENTS[int(row.segments[index])]} · {state}"


def token_classes(sample: Sample, index: int) -> list[str]:
    row = sample.row
    classes = ["t", segment_class(int(row.segments[index]))]
    if index >= row.kept:
        classes += ["cut"] + (["lost"] if row.supervised[index] else [])
    elif row.supervised[index]:
        classes.append("sup")
    return classes


def sample_facts(sample: Sample) -> str:
    row = sample.row
    supervised = int(row.supervised[: row.kept].sum())
    facts = f"{len(row.ids)} tokens, {supervised} supervised"
    if row.truncated:
        facts += f"; cut to --max_seq_len {row.max_seq_len}"
    reason = row.drop_reason()
    if reason:
        facts += f"; DROPPED: {reason[0]} ({reason[1]})"
    blocks, tokens = row.supervised_empty_thinks()
    if blocks:
        facts += f"; {blocks} supervised empty think block(s), {tokens} tokens"
    return facts


def tokens_html(sample: Sample) -> str:
    """The row's tokens as spans inside ``<pre class="tokens">``."""
    row, parts = sample.row, []
    for index, (start, end) in enumerate(row.pieces()):
        piece = row.text[start:end]
        classes = token_classes(sample, index) + (["nl"] if "\n" in piece else [])
        parts.append(f'<span class="{" ".join(classes)}" title="{html.escape(token_title(sample, index))}">'
                     f"{html.escape(piece, quote=False)}</span>")
    return '<pre class="tokens">' + "".join(parts) + "</pre>"


def _table_html(report_list: list[SourceReport]) -> str:
    out = ['<table class="segments"><tr><th>segment</th><th>tokens</th><th>supervised</th><th>share of loss</th>'
           "<th>cut by --max_seq_len</th></tr>"]
    for cells in segment_rows(report_list):
        out.append("<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in cells) + "</tr>")
    return "".join(out) + "</table>"


def legend_html() -> str:
    keys = "".join(f'<span class="key {segment_class(k)}">{html.escape(name)}</span>' for k, name in enumerate(SEGMENTS))
    return ('<div class="legend"><span class="t sup">supervised (carries loss)</span> '
            '<span class="t">not supervised</span> <span class="t cut">cut by --max_seq_len</span> '
            '<span class="t cut lost">supervised, but cut</span> · boundaries: grey lines · hover: token id · '
            f"underline: segment {keys}</div>")


def html_page(reports: list[SourceReport], samples: list[Sample], title: str, meta: list[str]) -> str:
    """A self-contained page: summary, per-segment tables, warnings, legend and the samples."""
    body = [f"<h1>{html.escape(title)}</h1>", '<p class="meta">' + " · ".join(map(html.escape, meta)) + "</p>"]
    warnings = [warning for report in reports for warning in report.warnings()]
    if warnings:
        body.append("<h2>Warnings</h2><ul>" + "".join(f'<li class="warn">{html.escape(w)}</li>' for w in warnings)
                    + "</ul>")
    body.append("<h2>Tokens per segment</h2>")
    for report in reports:
        dropped = sum(report.dropped.values())
        about = [f"<h3>{html.escape(report.name)} ({html.escape(report.spec)}): {html.escape(report.sampled_text())}</h3>",
                 f'<p class="facts">{report.kept} rows kept, {dropped} dropped, {report.bad} bad; {report.truncated} '
                 f"longer than --max_seq_len {report.max_seq_len} (cut); {report.empty_thinks} of "
                 f"{report.trained_turns} trained assistant turns learn an empty think block "
                 f"({percent(report.empty_think_tokens, int(report.supervised.sum()))} of the loss tokens)</p>"]
        about += [f'<p class="facts">dropped {count}: {html.escape(reason)} (e.g. '
                  f"{html.escape(report.drop_examples[reason])})</p>" for reason, count in report.dropped.most_common()]
        body.append(f'<div class="source"><div class="about">{"".join(about)}</div>{_table_html([report])}</div>')
    if len(reports) > 1:
        body.append("<h3>all sources</h3>" + _table_html(reports))
    body.append(f"<h2>Samples ({len(samples)})</h2>" + legend_html())
    for sample in samples:
        body.append(f'<section class="sample"><h3>{html.escape(sample.source)} · {html.escape(sample.location)}</h3>'
                    f'<p class="facts">{html.escape(sample_facts(sample))}</p>{tokens_html(sample)}</section>')
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


# --------------------------------------------------------------------------- terminal

RESET = "\x1b[0m"
SUPERVISED_STYLES = ("\x1b[38;5;16;48;5;221m", "\x1b[38;5;16;48;5;179m")  # black on two yellows, alternating
PLAIN_STYLES = ("\x1b[38;5;252;48;5;236m", "\x1b[38;5;252;48;5;239m")  # light grey on two dark greys
CUT_STYLE = "\x1b[9;38;5;244m"  # struck through, grey


def terminal_legend(colour: bool = True) -> str:
    if not colour:
        return "tokens between ¦ ; supervised runs in «...»; cut by --max_seq_len after ✂; ↵ a newline"
    return (f"{SUPERVISED_STYLES[0]}supervised{RESET}{SUPERVISED_STYLES[1]}tokens{RESET}  "
            f"{PLAIN_STYLES[0]}not{RESET}{PLAIN_STYLES[1]}supervised{RESET}  {CUT_STYLE}cut by --max_seq_len{RESET}"
            "  (token boundaries: the background alternates; ↵ a newline)")


def terminal_view(sample: Sample, colour: bool = True) -> str:
    """One row for a terminal: a header line, the tokens, its tokens per segment."""
    row = sample.row
    header = printable(f"── {sample.source} · {sample.location} · {sample_facts(sample)}")
    out = [f"\x1b[1m{header}{RESET}\n" if colour else header + "\n"]
    supervised_run = False
    for index, (start, end) in enumerate(row.pieces()):
        piece = printable(row.text[start:end]).replace("\n", "↵\n")
        if colour:
            style = CUT_STYLE if index >= row.kept else (
                SUPERVISED_STYLES if row.supervised[index] else PLAIN_STYLES)[index % 2]
            out.append("\n".join(f"{style}{line}{RESET}" if line else "" for line in piece.split("\n")))
            continue
        supervised = index < row.kept and bool(row.supervised[index])
        mark = "»" if supervised_run and not supervised else ""
        mark += ("¦" if index else "") + ("✂" if index == row.kept else "")
        mark += "«" if supervised and not supervised_run else ""
        supervised_run = supervised
        out.append(mark + piece)
    if supervised_run:
        out.append("»")
    counts, learned = row.counts() + row.counts(kept=False), row.counts(supervised_only=True)
    out.append("\n   tokens per segment (supervised): " + ", ".join(
        f"{name} {counts[k]} ({learned[k]})" for k, name in enumerate(SEGMENTS) if counts[k]) + "\n")
    return "".join(out)
