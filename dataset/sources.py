"""Reading data files as raw lines: plain ``.jsonl``, gzip-compressed ``.jsonl.gz`` or
``.parquet`` (each row becomes one JSON line, so row N is reported as ``file:N``).

The token cache reads every file through ``open_lines`` so a compressed file yields exactly the
bytes (and line numbers) of its uncompressed twin; parsing stays in ``formats``.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from .formats import DataError


def is_gzip(path: Path) -> bool:
    return path.name.endswith(".gz")


def open_lines(path: Path) -> Iterator[bytes]:
    """Yield the raw lines of ``path`` (decompressed for ``.gz``), streaming, never the whole file.

    A truncated or corrupt ``.gz`` raises one-line ``DataError`` naming the file.
    """
    if path.suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    if not is_gzip(path):
        with path.open("rb") as f:
            yield from f
        return
    try:
        with gzip.open(path, "rb") as f:
            yield from f
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: not a readable gzip file ({exc}); recompress it or pass the .jsonl") from None


PARQUET_BATCH_ROWS = 1024


def _parquet_rows(path: Path) -> Iterator[bytes]:
    """Each row of a parquet file as one JSON line, read one record batch at a time."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS)
        for batch in batches:
            for row in batch.to_pylist():
                yield json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n"
    except (pyarrow.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable parquet file ({exc})") from None


def check_data_file(path: Path) -> None:
    """Raise a one-line ``DataError`` if the data file is missing, a directory, one JSON array or
    has no non-blank line."""
    if path.is_dir():
        raise DataError(f"{path}: is a directory; give a .jsonl, .jsonl.gz or .parquet file here (only "
                        "--data_path takes a directory of shards)")
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    first = next((line.strip().removeprefix(b"\xef\xbb\xbf").lstrip() for line in open_lines(path) if line.strip()), b"")
    if not first:
        raise DataError(f"{path}: data file is empty")
    if first.startswith(b"[") and not _is_json(first):
        raise DataError(
            f"{path}: is one JSON array, not JSON Lines (one conversation object per line); "
            "convert it first, e.g. jq -c '.[]' in.json > out.jsonl"
        )


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except (ValueError, RecursionError):
        return False
    return True
