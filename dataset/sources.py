"""Reading data files as raw lines: plain ``.jsonl`` (or ``.json``, JSON Lines too),
gzip-compressed ``.jsonl.gz`` or ``.parquet``, suffixes in any case (each parquet row becomes one
JSON line of the columns a row is read from, so row N is reported as ``file:N``; see
``_parquet_rows``).

The token cache reads every file through ``open_lines`` so a compressed file yields exactly the
bytes (and line numbers) of its uncompressed twin; parsing stays in ``formats``.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from .formats import ROW_KEYS, ROW_PROBLEM, DataError, repeated_key


def is_gzip(path: Path) -> bool:
    return path.name.lower().endswith(".gz")


def is_parquet(path: Path) -> bool:
    return path.suffix.lower() == ".parquet"


def open_lines(path: Path, keys: tuple[str, ...] = ROW_KEYS) -> Iterator[bytes]:
    """Yield the raw lines of ``path`` (decompressed for ``.gz``), streaming, never the whole file.

    ``keys``: the columns a parquet row's line holds (a jsonl line holds all its keys); an
    evaluation adds the ``task`` a row names. A truncated or corrupt ``.gz`` raises one-line
    ``DataError`` naming the file.
    """
    if is_parquet(path):
        yield from _parquet_rows(path, keys)
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


def _parquet_rows(path: Path, keys: tuple[str, ...]) -> Iterator[bytes]:
    """Each row of a parquet file as one JSON line, read one record batch at a time.

    Only the columns ``keys`` are read (for training ``formats.ROW_KEYS``, the keys a row is read
    from or refused for): other columns (ids, timestamps, images as binary) do not matter, as other keys of a
    jsonl line do not. A null column or struct field is an absent key (see ``_converter``); a row
    holding a value JSON has no type for is that row's problem (``formats.ROW_PROBLEM``).
    """
    import pyarrow
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        names = [name for name in parquet.schema_arrow.names if name in keys]
        twice = repeated_key(names)
        if twice is not None:
            raise _RepeatedField(f"the column {twice!r} twice")
        converters = None
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=names):
            if converters is None:
                converters = [(field.name, _converter(field.type, field.name)) for field in batch.schema]
            columns = [(name, convert, column.to_pylist()) for (name, convert), column in zip(converters, batch.columns)]
            for index in range(batch.num_rows):
                yield _row_line(columns, index)
    except (pyarrow.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable parquet file ({exc})") from None
    except _RepeatedField as exc:
        raise DataError(f"{path}: parquet schema holds {exc} (which value is meant is not guessed)") from None


class _RepeatedField(ValueError):
    """A parquet schema with a name twice where a row's JSON object would hold a key twice: two
    columns, or two fields of one struct."""


class _NotJSONType(ValueError):
    """A parquet value a row's JSON cannot hold: of a type JSON does not have (timestamp, binary,
    decimal, ...), or a map holding a key twice."""


def _row_line(columns: list, index: int) -> bytes:
    row = {}
    try:
        for name, convert, values in columns:
            if values[index] is not None:
                row[name] = convert(values[index])
    except _NotJSONType as exc:
        return f"{ROW_PROBLEM}{exc}\n".encode("utf-8")
    return json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n"


def _identity(value):
    return value


def _converter(arrow_type, where: str):
    """A function from a non-null ``to_pylist`` value of ``arrow_type`` to its JSON value (a map
    becomes an object).

    A struct's null fields are left out: pyarrow writes Python dicts as structs holding the union
    of every row's keys, null where a row lacked one, so a null field is taken as an absent key
    (a null the data means must be written inside a JSON string, or in a map column, whose keys
    are the row's own). Nulls in lists and maps are kept. Types JSON has no value for, and a map
    holding a key twice, raise ``_NotJSONType`` naming the field (``messages[].created_at``); a
    struct type with a field name twice raises ``_RepeatedField`` (the whole file's schema).
    """
    import pyarrow.types as types

    def has(name: str) -> bool:  # type tests of newer pyarrow versions
        return getattr(types, name, lambda _: False)(arrow_type)

    if types.is_struct(arrow_type):
        fields = [arrow_type.field(k) for k in range(arrow_type.num_fields)]
        twice = repeated_key(field.name for field in fields)
        if twice is not None:
            raise _RepeatedField(f"the field {twice!r} twice in the struct of column {where}")
        fields = [(field.name, _converter(field.type, f"{where}.{field.name}")) for field in fields]

        def struct(value: dict) -> dict:
            return {name: convert(value[name]) for name, convert in fields if value[name] is not None}

        return struct
    if types.is_map(arrow_type):
        if not (types.is_string(arrow_type.key_type) or types.is_large_string(arrow_type.key_type)):
            return _unsupported(arrow_type, where)
        convert = _converter(arrow_type.item_type, f"{where}{{}}")

        def mapping(pairs: list) -> dict:
            obj = {key: None if item is None else convert(item) for key, item in pairs}
            if len(obj) != len(pairs):  # a map may repeat a key, which a row's JSON object may not (formats.loads)
                twice = repeated_key(key for key, _ in pairs)
                raise _NotJSONType(f"parquet column {where} holds the key {twice!r} twice in one map "
                                   "(which value is meant is not guessed)")
            return obj

        return mapping
    if (types.is_list(arrow_type) or types.is_large_list(arrow_type) or types.is_fixed_size_list(arrow_type)
            or has("is_list_view") or has("is_large_list_view")):
        convert = _converter(arrow_type.value_type, f"{where}[]")
        return lambda items: [None if item is None else convert(item) for item in items]
    if types.is_dictionary(arrow_type) or has("is_run_end_encoded"):
        return _converter(arrow_type.value_type, where)
    if (types.is_string(arrow_type) or types.is_large_string(arrow_type) or has("is_string_view")
            or types.is_boolean(arrow_type) or types.is_integer(arrow_type) or types.is_null(arrow_type)):
        return _identity
    if types.is_floating(arrow_type):
        return float  # a NaN or inf is written as such, and formats rejects it as not JSON
    return _unsupported(arrow_type, where)


def _unsupported(arrow_type, where: str):
    def refuse(value):
        raise _NotJSONType(f"parquet column {where} holds a {arrow_type} value, which JSON has no type for; "
                           "store it as a string")

    return refuse


def missing_file(path: Path) -> str:
    """Why ``path``, which is no directory, is not a data file: not found, or a pipe or device."""
    if path.exists():
        return ("is a pipe or device, not a file: the data is read more than once (hashed, counted, tokenized); "
                "write it to a file and give that")
    return "data file not found"


BOM = b"\xef\xbb\xbf"  # the UTF-8 byte order mark some editors write at the start of a file


def check_data_file(path: Path) -> None:
    """Raise a one-line ``DataError`` if the data file is missing, a directory, a pipe or device
    (read several times: hashed, counted, tokenized), gzip or parquet under another suffix, UTF-16
    text, one JSON array (on one line, as ``json.dump`` writes it, or spread over lines) or document
    spread over lines (a ``.json`` file must be JSON Lines too), has no non-blank line (a byte order
    mark alone is said to be one) or lines ended by carriage returns alone."""
    if path.is_dir():
        raise DataError(f"{path}: is a directory; give a .jsonl, .jsonl.gz, .json or .parquet file here (only "
                        "--data_path takes a directory of shards)")
    if not path.is_file():
        raise DataError(f"{path}: {missing_file(path)}")
    unreadable = _unreadable_as_named(path)
    if unreadable:
        raise DataError(f"{path}: {unreadable}")
    lines = (line.strip() for line in open_lines(path) if line.strip())
    first = next(lines, b"")
    marked = first == BOM  # a line holding only the mark: its row problem, unless no row follows
    if marked:
        first = next(lines, b"")
    first, second = first.removeprefix(BOM).lstrip(), next(lines, b"").removeprefix(BOM).lstrip()
    if not first:
        raise DataError(f"{path}: holds only a UTF-8 byte order mark, no rows" if marked else f"{path}: data file is empty")
    if b"\r" in first and not _is_json(first) and _is_json(first.split(b"\r")[0]):
        raise DataError(f"{path}: its lines end in a carriage return alone (\\r, no \\n): it reads as one line; "
                        "convert the line endings, e.g. tr '\\r' '\\n' < in.jsonl > out.jsonl")
    if first.startswith(b"[") and (not second or not _is_json(first)):  # the file's only line, or not JSON alone
        raise DataError(
            f"{path}: is one JSON array, not JSON Lines (one conversation object per line); "
            "convert it first, e.g. jq -c '.[]' in.json > out.jsonl"
        )
    if first == b"{" and second.startswith(b'"'):  # '{' alone, then '"key": ...': a pretty-printed object
        raise DataError(
            f"{path}: is one JSON document spread over several lines, not JSON Lines (one conversation object per "
            "line); convert it (e.g. jq -c . in.json > out.jsonl), or keep it out of a directory of shards"
        )


def _unreadable_as_named(path: Path) -> str | None:
    """Why a file cannot be read under its name, by its first bytes, or None: gzip or parquet under
    another suffix (files are read by their suffix), UTF-16 text (what Windows PowerShell's ``>``
    writes). Read as UTF-8 text, their first line is "invalid UTF-8" or "invalid JSON"."""
    with path.open("rb") as handle:
        head = handle.read(4)
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) and not is_gzip(path) and not is_parquet(path):
        return (f"is UTF-16 text, not UTF-8: convert it, e.g. iconv -f UTF-16 -t UTF-8 {path.name} > "
                f"{path.stem}.utf8{path.suffix}")
    if head.startswith(b"\x1f\x8b") and not is_gzip(path):
        return f"is gzip-compressed, but its name does not end in .gz: rename it (e.g. {path.name}.gz)"
    if head == b"PAR1" and not is_parquet(path):
        return (f"is a parquet file, but its name does not end in .parquet: rename it "
                f"(e.g. {path.with_suffix('.parquet').name})")
    return None


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except (ValueError, RecursionError):
        return False
    return True
