"""Data preparation per core, ours against MiniMind's per-sample way.

    python scripts/bench_prep.py --max_seq_len 1024

Both sides start from the same jsonl lines (demo rows) and use the same tokenizer (the shipped
``model/tokenizer``), in this one process, with the tokenizer's own threads off
(``TOKENIZERS_PARALLELISM=false``): one core each. Figures: docs/benchmarks.md.

* ours: what a build worker does with a chunk of lines (``dataset.cache.build.encode_chunk``
  through the seam ``dataset.tokens.encode_conversations``): parse,
  render through the chat template, every assistant turn's loss span, tokenize, loss mask, cut to
  ``--max_seq_len``; a fresh encoder per data set (its remembered system turns start empty).
* minimind: MiniMind's ``SFTDataset.__getitem__`` written out (the data is loaded once, so the
  ``json.loads`` of the line is counted here as our parse is): tools and tool calls decoded from
  their JSON strings, ``apply_chat_template`` to a string, ``tokenizer(prompt).input_ids`` cut to
  ``max_seq_len`` and padded to it, then the labels found by scanning the padded ids for the
  token sequences of ``<|im_start|>assistant\\n`` and ``<|im_end|>\\n``, and both made tensors
  (what ``__getitem__`` returns). Its two augmentations (a
  random system prompt, dropping empty think blocks) are left out, as ours are off by default.
* minimind (no pads): the same, with the label scan over the unpadded ids (what it would cost
  without padding; MiniMind pads in ``__getitem__``).
* ours whole: ours with every text tokenized whole (no piece of text remembered: what data
  without any repeated system prompt, tools block, call or reply would cost); general: ours
  through the general path for every row (``rendering.encode_with_template``: what the seam runs
  for a template other than ChatML). Both give the same ids and masks as ours (checked).

The rows are timed in rounds (a chunk of ours, the same chunk the MiniMind ways, in turn), so a
change of the machine's load hits both alike. rows/s per core = rows / CPU seconds of the process
(``time.process_time``); wall rows/s beside it. The token ids of both sides are compared row by
row; MiniMind's labels also cover the newline after each ``<|im_end|>``, which ours do not (a
template's text after the end-of-turn token is not the model's to write), so the masks are
compared without those newlines.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._common import ArgumentParser, check_output_file, fail, run_main  # noqa: E402
from trainer.args import DEFAULT_TRAIN_DATA, add_flag, flag_bounds  # noqa: E402

PREP_SETS = ("plain", "tool")


def split_rows(path: str | Path) -> dict[str, list[bytes]]:
    """The file's plain two-turn chats (a user turn and an assistant reply, a system prompt or not;
    no tools, tool calls or reasoning) and its tool rows (tools offered; tool calls, results and
    reasoning)."""
    sets = {name: [] for name in PREP_SETS}
    with open(path, "rb") as handle:
        for raw in handle:
            if not raw.strip():
                continue
            row = json.loads(raw)
            messages = row.get("conversations") or row.get("messages") or []
            roles = [message.get("role") for message in messages]
            if any(message.get("tools") for message in messages) or row.get("tools"):
                sets["tool"].append(raw)
            elif roles in (["user", "assistant"], ["system", "user", "assistant"]) and not any(
                    message.get("reasoning_content") or message.get("tool_calls") for message in messages):
                sets["plain"].append(raw)
    return sets


class MiniMindPrep:
    """MiniMind's per-sample preprocessing (module docstring), written for this benchmark."""

    def __init__(self, tokenizer, max_seq_len: int, pad: bool = True):
        self.tokenizer, self.max_seq_len, self.pad = tokenizer, max_seq_len, pad
        self.start = tokenizer(f"{tokenizer.bos_token}assistant\n", add_special_tokens=False).input_ids
        self.end = tokenizer(f"{tokenizer.eos_token}\n", add_special_tokens=False).input_ids

    def prompt(self, conversations: list[dict]) -> str:
        messages, tools = [], None
        for message in conversations:
            message = dict(message)
            if message.get("role") == "system" and message.get("tools"):
                tools = message["tools"]
                tools = json.loads(tools) if isinstance(tools, str) else tools
            if message.get("tool_calls") and isinstance(message["tool_calls"], str):
                message["tool_calls"] = json.loads(message["tool_calls"])
            messages.append(message)
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, tools=tools)

    def labels(self, ids: list[int]) -> list[int]:
        """-100 except from after each assistant start sequence to the end of the next end sequence."""
        start, end, size = self.start, self.end, len(ids)
        labels = [-100] * size
        position = 0
        while position < size:
            if ids[position:position + len(start)] == start:
                first = position + len(start)
                stop = first
                while stop < size and ids[stop:stop + len(end)] != end:
                    stop += 1
                for index in range(first, min(stop + len(end), self.max_seq_len)):
                    labels[index] = ids[index]
                position = stop + len(end) if stop < size else size
            else:
                position += 1
        return labels

    def __call__(self, raw: bytes):
        """(input_ids, labels) as the tensors MiniMind's ``__getitem__`` returns, and the unpadded length."""
        import torch

        sample = json.loads(raw)
        ids = self.tokenizer(self.prompt(sample["conversations"])).input_ids[: self.max_seq_len]
        length = len(ids)
        if self.pad:
            ids = ids + [self.tokenizer.pad_token_id] * (self.max_seq_len - length)
        labels = self.labels(ids)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long), length


def _encoding(encoder):
    """``encode_chunk``'s ``encode`` through this encoder instead of the seam."""
    return lambda conversations, max_seq_len: encoder.encode(conversations)


def _timed(function, *args):
    gc.collect()  # every way starts from the same collector state, not with another way's garbage
    cpu, wall = time.process_time(), time.perf_counter()
    result = function(*args)
    return result, time.process_time() - cpu, time.perf_counter() - wall


def compare(ours: dict, minimind_rows: list, newline: int | None) -> tuple[int, int]:
    """(rows whose ids are equal, rows whose masks are equal but for MiniMind's newline after each
    end of turn), over the rows ours kept, in order."""
    import numpy as np

    ids_equal = masks_equal = 0
    offset = 0
    kept = [row for row in minimind_rows if bool((row[1] != -100).any())]  # ours drops a row without loss tokens
    for length, (ids, labels, their_length) in zip(ours["lengths"], kept):
        our_ids = ours["ids"][offset:offset + length]
        our_mask = ours["mask"][offset:offset + length]
        offset += length
        ids, labels = ids.numpy()[:their_length], labels.numpy()[:their_length]
        if their_length != length or not np.array_equal(our_ids, ids):
            continue
        ids_equal += 1
        theirs = np.asarray(labels) != -100
        after_end = np.zeros(length, dtype=bool)
        after_end[1:] = (our_ids[:-1] == ours["end_id"]) & (our_ids[1:] == newline)
        masks_equal += bool(np.array_equal(our_mask, theirs & ~after_end))
    return ids_equal, masks_equal


WAYS = ("ours", "ours_whole", "ours_general", "minimind", "minimind_nopad")
LEGEND = ("  ours = the build's chunk encoder; ours whole = the same with every text tokenized whole (no piece "
          "remembered); general = the general path for every row (what the build runs for a template the fast path "
          "does not cover); minimind = its __getitem__; mm no pads = its label scan without the pads")
COLUMNS = [("ours", "ours"), ("ours_whole", "ours whole"), ("ours_general", "general"), ("minimind", "minimind"),
           ("minimind_nopad", "mm no pads")]


def run_prep(options, tokenizer, machine: str = "") -> dict:
    """Time the ways on both data sets (module docstring); print the table and return the figures."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core: no tokenizer threads
    from dataset.cache.build import CHUNK_LINES, encode_chunk
    from dataset.chatml_encoder import ChatMLEncoder
    from dataset.tokens import encode_conversations

    sets = split_rows(options.data_path)
    newline = tokenizer("\n", add_special_tokens=False).input_ids
    newline = newline[0] if len(newline) == 1 else None
    end_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    minimind = {"minimind": MiniMindPrep(tokenizer, options.max_seq_len),
                "minimind_nopad": MiniMindPrep(tokenizer, options.max_seq_len, pad=False)}
    print(f"machine: {machine}")
    print(f"prep: rows/s per core = rows / CPU s of this process (tokenizer threads off); max_seq_len "
          f"{options.max_seq_len}; {options.prep_rows or 'all'} rows per set, each once, in chunks of "
          f"{CHUNK_LINES}, every way on a chunk in turn; data {options.data_path}")
    print(LEGEND)
    print(f"{'data':<6} {'rows':>6} {'tok/row':>7} " + " ".join(f"{title:>10}" for _, title in COLUMNS)
          + f" {'x minimind':>10} {'x no pads':>9} {'whole x mm':>10}  same ids, same masks")
    results = []
    for name in PREP_SETS:
        rows = sets[name][: options.prep_rows or None]  # distinct rows: repeating them would flatter the piece cache
        if not rows:
            continue
        fresh = copy.deepcopy(tokenizer)  # the seam keeps an encoder per tokenizer: nothing remembered from another set
        whole = ChatMLEncoder(tokenizer, options.max_seq_len)
        whole.split_pattern = None
        general = ChatMLEncoder(tokenizer, options.max_seq_len)
        general.fast = False
        encoders = {"ours": functools.partial(encode_conversations, fresh),
                    "ours_whole": _encoding(whole), "ours_general": _encoding(general)}
        cpu = {way: 0.0 for way in WAYS}
        wall = dict(cpu)
        equal_ids = equal_masks = kept = tokens = 0
        for first in range(0, len(rows), CHUNK_LINES):
            chunk = rows[first:first + CHUNK_LINES]
            task = (first + 1, chunk, options.max_seq_len)
            outputs = {}
            for way in WAYS:
                if way in encoders:
                    outputs[way], seconds, elapsed = _timed(encode_chunk, task, encoders[way])
                else:
                    outputs[way], seconds, elapsed = _timed(lambda: [minimind[way](raw) for raw in chunk])
                cpu[way] += seconds
                wall[way] += elapsed
            ours = outputs["ours"]
            assert not ours["bad"], ours["bad"][:1]
            assert all((ours[key] == outputs[way][key]).all() for key in ("ids", "mask", "lengths")
                       for way in ("ours_whole", "ours_general"))
            same = compare({**ours, "end_id": end_id}, outputs["minimind"], newline)
            equal_ids, equal_masks = equal_ids + same[0], equal_masks + same[1]
            kept += len(ours["lengths"])
            tokens += int(ours["lengths"].sum())
        rate = {way: len(rows) / max(seconds, 1e-9) for way, seconds in cpu.items()}
        result = {"data": name, "rows": len(rows), "tokens_per_row": tokens / max(kept, 1),
                  **{f"{way}_rows_per_core_s": rate[way] for way in WAYS},
                  **{f"{way}_wall_rows_per_s": len(rows) / max(seconds, 1e-9) for way, seconds in wall.items()},
                  "x_minimind": rate["ours"] / rate["minimind"], "x_minimind_nopad": rate["ours"] / rate["minimind_nopad"],
                  "whole_x_minimind": rate["ours_whole"] / rate["minimind"],
                  "general_x_minimind": rate["ours_general"] / rate["minimind"],
                  "same_ids": equal_ids, "same_masks": equal_masks, "cpu_s": cpu}
        results.append(result)
        print(f"{name:<6} {len(rows):>6} {result['tokens_per_row']:>7.0f} "
              + " ".join(f"{rate[way]:>10.0f}" for way, _ in COLUMNS)
              + f" {result['x_minimind']:>10.2f} {result['x_minimind_nopad']:>9.2f} {result['whole_x_minimind']:>10.2f}"
              f"  {equal_ids}/{kept}, {equal_masks}/{kept}" + (f" ({len(rows) - kept} without loss tokens)" if kept < len(rows) else ""),
              flush=True)
    summary = "summary: ours / minimind rows per core: " + ", ".join(
        f"{result['data']} {result['x_minimind']:.2f}x (target >= 3: {'met' if result['x_minimind'] >= 3 else 'NOT met'}; "
        f"{result['x_minimind_nopad']:.2f}x its scan without pads; texts whole {result['whole_x_minimind']:.2f}x)"
        for result in results)
    print(summary)
    return {"machine": machine, "prep": results, "summary": summary}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description="Rows per core of our data preparation (parse, template, loss spans, "
                                        "tokenize) against MiniMind's per-sample preprocessing, on plain and on "
                                        "tool/reasoning rows.", epilog="Figures: docs/benchmarks.md.")
    parser.add_argument("--data_path", default=DEFAULT_TRAIN_DATA,
                        help="SFT jsonl file")
    parser.add_argument("--max_seq_len", type=int, default=512).bounds = flag_bounds("max_seq_len")
    add_flag(parser, "--rows", dest="prep_rows", type=int, default=0, at_least=0,
             help="rows of each data set (plain, tool), each row once; 0 = all of the file's")
    parser.add_argument("--json_out", default=None, help="also write every figure to this JSON file")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    options = parser.parse_args(argv)  # the ranges: checked by parse_args
    check_output_file(options.json_out, "--json_out")
    if not Path(options.data_path).is_file():
        fail(f"{options.data_path}: data file not found")
    import torch

    from dataset import load_tokenizer
    from scripts._bench_common import machine_description, write_report

    write_report(options, run_prep(options, load_tokenizer(None), machine_description(torch.device("cpu"))))
    return 0


if __name__ == "__main__":
    run_main(main)
