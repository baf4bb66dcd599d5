"""Show what training data teaches: per source and per segment the tokens and supervised tokens,
the rows dropped by truncation and why, what looks wrong, and pictures of a few rows.

    python scripts/inspect_data.py --data_path dataset/demo/sft_train.jsonl --max_seq_len 256 --html data.html

``--data_path``, ``--tokenizer_path``, ``--max_seq_len`` and ``--from_weight`` mean what they mean
to the trainer (a mixture ``a.jsonl:3,shards/`` too; the tokenizer is ``--tokenizer_path``, else the
``--from_weight`` weights' own, a resume checkpoint's copy of its run's tokenizer included, else the
shipped one). Each conversation is rendered,
tokenized and masked exactly as the token cache does it, and every token is attributed to the
segment that produced it (system, tools block, user, tool result, think block, reply, tool call,
end-of-turn, template: ``dataset/inspection/segments.py``). Prints a report per source (``dataset/inspection/report.py``);
``--html FILE`` writes a self-contained page of ``--samples`` rows, ``--terminal`` (the default when
stdout is a terminal) prints them in colour (``dataset/inspection/token_view.py``). docs/inspect_data.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._common import (  # noqa: E402
    ArgumentParser, check_not_an_input, check_output_file, fail, run_main, write_output,
)
from trainer.args import DEFAULT_TRAIN_DATA, add_flag, flag_bounds, path_value  # noqa: E402


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[0], prog="inspect_data.py")
    parser.add_argument("--data_path", default=DEFAULT_TRAIN_DATA,
                        help="as the trainer's: files, directories or globs, comma-separated, each with an optional :weight")
    parser.add_argument("--tokenizer_path", default=None,
                        help="tokenizer dir; default: the one saved with --from_weight's weights, else the shipped one")
    parser.add_argument("--max_seq_len", type=int, default=512,
                        help="rows are cut to this many tokens, as in training").bounds = flag_bounds("max_seq_len")
    parser.add_argument("--from_weight", default=None,
                        help="weights to train from (an HF/run directory, .safetensors or .pth): is their tokenizer "
                             "and chat template the one used here?")
    add_flag(parser, "--rows", type=int, default=1000, at_least=0,
             help="rows read per source, spread evenly over it (0: all)")
    add_flag(parser, "--samples", type=int, default=3, at_least=0, help="rows shown by --html and --terminal")
    parser.add_argument("--html", default=None, type=path_value, metavar="FILE", help="write a self-contained HTML page of the samples")
    parser.add_argument("--terminal", action=argparse.BooleanOptionalAction, default=None,
                        help="print the samples in colour (default: when stdout is a terminal; NO_COLOR: no colour)")
    parser.add_argument("--json_out", default=None, type=path_value, metavar="FILE", help="write the figures as JSON")
    return parser


def choose_tokenizer(args) -> tuple[object, str, list[str]]:
    """(tokenizer, where it came from, lines about --from_weight's tokenizer): the trainer's choice
    (trainer/weights/tokenizer.py), except that a --tokenizer_path other than the weights' own (by the
    trainer's rule, `compare_with_own`) is shown with what differs instead of refused."""
    from dataset.rendering import load_tokenizer
    from trainer.weights.inference import own_tokenizer_at
    from trainer.weights.tokenizer import SAVED, compare_with_own, load_own, tokenizer_differences

    own = None
    if args.from_weight:
        if not Path(args.from_weight).exists():
            fail(f"--from_weight {args.from_weight}: not found (give the weights' path)")
        own = own_tokenizer_at(args.from_weight)
    if args.tokenizer_path or own is None:
        tokenizer = load_tokenizer(args.tokenizer_path)
    else:
        tokenizer = load_own(own, args.from_weight)
    origin = "--tokenizer_path" if args.tokenizer_path else (own.how if own else "the shipped one")
    path = args.tokenizer_path or (own.where() if own else "model/tokenizer")
    name = f"{path} ({origin}, {len(tokenizer)} tokens)"
    notes = []
    whose = ("saved with --from_weight's weights" if own and own.how == SAVED
             else "--from_weight's run recorded")
    if args.from_weight and own is None:
        notes.append(f"note: --from_weight {args.from_weight} has no tokenizer saved with it; training uses "
                     f"{'--tokenizer_path' if args.tokenizer_path else 'the shipped one'}: make sure the weights "
                     "were trained with it")
    elif own and args.tokenizer_path:
        comparison = compare_with_own(tokenizer, own, args.from_weight)
        note = comparison.note(args.tokenizer_path)
        if comparison.same is False:
            differences = (tokenizer_differences(tokenizer, comparison.theirs) if comparison.theirs is not None else
                           [f"fingerprint {own.fingerprint_of(tokenizer)[:16]} against {own.fingerprint[:16]} recorded"])
            notes.append(f"warning: --tokenizer_path {args.tokenizer_path} differs from the tokenizer {whose} "
                         f"({own.name()}): {'; '.join(differences)}; the weights learned another "
                         "text than this data would train (leave --tokenizer_path out to use theirs)")
        elif note is None:
            notes.append(f"--tokenizer_path {args.tokenizer_path} is the tokenizer {whose} (same fingerprint)")
        notes += [note] if note else []
    return tokenizer, name, notes


def check_position_tables(args, tokenizer) -> None:
    """The trainer's bound on --max_seq_len, refused in its one line (exit 2) before any row is read:
    the RoPE tables of the model it would build (its default architecture) must fit in memory."""
    from trainer.args import build_parser as trainer_parser
    from trainer.model_setup import build_model_config

    build_model_config(trainer_parser().parse_args(["--max_seq_len", str(args.max_seq_len)]), tokenizer)


def file_problems(sources) -> list[str]:
    """What the trainer refuses a data file for before reading its rows (empty, one JSON array, ...)."""
    from dataset.formats import DataError
    from dataset.sources import check_data_file

    problems = []
    for path in (path for source in sources for path in source.files):
        try:
            check_data_file(path)
        except DataError as exc:
            problems.append(f"{exc} (training refuses this file)")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # ranges checked (scripts/_common.ArgumentParser)
    for flag in ("html", "json_out"):
        check_output_file(getattr(args, flag), f"--{flag}")
    from dataset.inspection.report import inspect_source, report_lines, segment_table
    from dataset.mixture import parse_data_path
    from dataset.inspection.token_view import html_page, terminal_legend, terminal_view
    from dataset.printable import printable

    tokenizer, tokenizer_name, notes = choose_tokenizer(args)
    check_position_tables(args, tokenizer)
    sources = parse_data_path(args.data_path)
    for flag in ("html", "json_out"):
        check_not_an_input(getattr(args, flag), f"--{flag}", [path for source in sources for path in source.files])
    per_source = math.ceil(args.samples / len(sources)) if args.samples else 0
    reports = [inspect_source(source, tokenizer, args.max_seq_len, args.rows, per_source) for source in sources]
    samples = [sample for report in reports for sample in report.samples][: args.samples]

    meta = [f"data: {args.data_path}", f"tokenizer: {tokenizer_name}", f"--max_seq_len {args.max_seq_len}"]
    lines = meta + [""]
    for report in reports:
        lines += report_lines(report) + [""]
    if len(reports) > 1:
        lines += ["all sources"] + segment_table(reports) + [""]
    warnings = file_problems(sources) + [warning for report in reports for warning in report.warnings()]
    lines += [f"warning: {warning}" for warning in warnings] + notes
    print(printable("\n".join(lines).rstrip("\n")))  # names and examples from the data, escaped

    terminal = args.terminal if args.terminal is not None else sys.stdout.isatty()
    if terminal and samples:
        colour = not os.environ.get("NO_COLOR")
        print("\n" + terminal_legend(colour))
        for sample in samples:
            print(terminal_view(sample, colour))
    if args.html:
        page = html_page(reports, samples, f"minisft data: {args.data_path}", meta + notes)
        write_output(args.html, page)
        print(f"wrote {args.html} ({len(samples)} samples)")
    elif not terminal and samples:
        print(f"(pictures of {len(samples)} rows: --html FILE or --terminal)")
    if args.json_out:
        result = {"max_seq_len": args.max_seq_len, "tokenizer": tokenizer_name, "notes": notes,
                  "sources": [report.to_json() for report in reports]}
        write_output(args.json_out, json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main)
