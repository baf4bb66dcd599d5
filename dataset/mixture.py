"""Training data from several sources with weights, in one flag (docs/data.md):

    --data_path general.jsonl:3,tools.parquet:1,shards/,'data/*.jsonl.gz'

A comma-separated list of sources, each with an optional trailing ``:weight`` (a positive number,
default 1; only a trailing ``:number`` is a weight, and a path that exists as written is never
split). A source is a file (``.jsonl``, ``.jsonl.gz``, ``.json``, ``.json.gz`` (JSON Lines too),
``.parquet``; in any case), a directory (its own data files, sorted, as one source; its other
files and subdirectories are named in the log) or a glob (its matching data files, sorted, as one
source). Every file keeps
a token cache of its own, so adding a source never re-tokenizes the others.

Counts per epoch (``epoch_counts``): an epoch has as many samples as all sources together
(``L = sum of sizes``); source ``i`` gets ``c_i`` of them, the largest-remainder rounding of
``L * w_i / sum(w)``. ``c_i = q * n_i + r`` is ``q`` full passes over the source plus ``r`` rows
taken from a fixed seeded permutation of the source, cyclically: epoch ``e`` takes positions
``e*r ... e*r + r - 1`` (mod ``n_i``), so consecutive epochs take other rows and over the epochs
every row is drawn equally often. The epoch's members (``EpochMixture.members``) depend only on
(seed, epoch), never on the world size; the sampler shuffles them (``dataset.sampler``). One source
of any weight gives every row once per epoch, exactly the single-file stream.
"""

from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from .formats import DataError
from .sources import missing_file

DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")  # any case: .JSONL is data too
GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Source:
    """One source of the mixture: its name in the metrics, the spec as given, its files and weight."""

    name: str
    spec: str
    files: tuple[Path, ...]
    weight: float = 1.0
    # what a directory or glob holds but is not read: other files and subdirectories (logged)
    ignored: tuple[Path, ...] = field(default=(), compare=False)


def is_data_file(path: Path) -> bool:
    return path.name.lower().endswith(DATA_SUFFIXES)


def is_glob(spec: str) -> bool:
    return any(char in spec for char in GLOB_CHARS)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def split_weight(part: str) -> tuple[str, str | None]:
    """(path, weight text or None): a trailing ``:number`` is a weight, unless the whole part exists."""
    if os.path.exists(part):
        return part, None
    head, colon, tail = part.rpartition(":")
    if colon and head and (_number(tail) is not None or os.path.exists(head) or glob.glob(head)):
        return head, tail
    return part, None


def split_commas(text: str | None) -> list[str]:
    """The items of a comma-separated list of paths (``--data_path``'s sources, ``--eval_data_path``'s
    files), each stripped, empty ones dropped; a path with commas that exists as written (with or
    without a ``:weight``) is one item."""
    text = (text or "").strip()
    if _comma_file(text):
        return [text]
    return [part.strip() for part in text.split(",") if part.strip()]


def comma_hint(text: str, spec: str) -> str:
    """Where ``spec``, a source of ``text`` that was not found, is part of a file whose name holds a
    comma: a sentence saying so, else ''."""
    pieces = text.split(",")
    for start in range(len(pieces)):
        for end in range(start + 2, len(pieces) + 1):
            joined = _comma_file(",".join(pieces[start:end]).strip())
            if joined and spec in joined:
                return (f" ({joined} is one file, but --data_path separates its sources at commas: "
                        "rename it, or link it under a name without a comma)")
    return ""


def _comma_file(part: str) -> str | None:
    """The path of ``part`` (a trailing ``:weight`` split off) when it holds a comma and exists."""
    path = split_weight(part)[0]
    return path if "," in path and os.path.exists(path) else None


def absolute_data_path(text: str) -> str:
    """``--data_path`` with every source's path made absolute and its weight kept (never raises)."""
    parts = []
    for part in split_commas(text):
        path, weight = split_weight(part)
        parts.append(os.path.abspath(path) + (f":{weight}" if weight is not None else ""))
    return ",".join(parts)


def parse_weight(part: str, path: str, text: str | None) -> float:
    if text is None:
        return 1.0
    weight = _number(text)
    if weight is None or not math.isfinite(weight) or weight <= 0:
        raise DataError(f"--data_path {part}: the weight {text!r} after ':' must be a positive number (e.g. {path}:2)")
    return weight


def source_files(spec: str) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """(data files, ignored entries) of one source: a file, a directory or a glob.

    A directory's data files are its own (sorted by name); its other files and its
    subdirectories are ignored (named in the log; a glob with ``**`` reads subdirectories),
    except hidden subdirectories (``.cache``, where token caches live by default, ``.git``)."""
    path = Path(spec)
    if path.is_dir():
        entries = sorted(entry for entry in path.iterdir() if not (entry.name.startswith(".") and entry.is_dir()))
        files = tuple(entry for entry in entries if entry.is_file() and is_data_file(entry))
        if not files:
            hint = f" (subdirectories are not read: use a glob such as '{spec}/**/*.jsonl')" if any(
                entry.is_dir() for entry in entries) else ""
            raise DataError(f"{spec}: directory holds no data files ({', '.join(DATA_SUFFIXES)}); give a directory of "
                            f"shards, a file or a glob{hint}")
        return files, tuple(entry for entry in entries if entry not in files)
    if path.exists() or not is_glob(spec):
        if not path.is_file():
            raise DataError(f"{spec}: {missing_file(path)}")
        return (path,), ()
    matches = sorted(Path(match) for match in glob.glob(spec, recursive=True))
    files = tuple(match for match in matches if match.is_file() and is_data_file(match))
    if not files:
        raise DataError(f"--data_path {spec}: no data file ({', '.join(DATA_SUFFIXES)}) matches this glob")
    return files, tuple(match for match in matches if match not in files and not (match.is_dir() and "**" in spec))


def parse_data_path(text: str) -> list[Source]:
    """The sources of ``--data_path``; a one-line ``DataError`` for a missing file, an empty
    directory or glob, or a bad weight."""
    parts = split_commas(text)
    if not parts:
        raise DataError("--data_path is empty: give a data file, a directory of shards or a glob")
    specs, weights = [], []
    for part in parts:
        path, weight_text = split_weight(part)
        weights.append(parse_weight(part, path, weight_text))
        specs.append(path)
    sources = []
    for name, spec, weight in zip(short_names(specs, fallback="data"), specs, weights):
        try:
            files, ignored = source_files(spec)
        except DataError as exc:
            raise DataError(f"{exc}{comma_hint(text, spec)}") from None
        sources.append(Source(name, spec, files, weight, ignored))
    check_no_file_twice(sources)
    return sources


def check_no_file_twice(sources: list[Source]) -> None:
    """A one-line ``DataError`` for a file read twice: given twice, given beside a directory or glob
    that holds it, or reached through a link beside itself. Each reading trains on all of its rows,
    so they would come twice as often per epoch as the others', silently."""
    first: dict[str, tuple[Source, Path]] = {}
    for source in sources:
        for path in source.files:
            earlier, given = first.setdefault(os.path.realpath(path), (source, path))
            if earlier is source and given == path:
                continue
            where = (f"in the sources {earlier.spec} and {source.spec}" if earlier is not source
                     else f"in the source {source.spec}, as {given} and {path}")
            raise DataError(f"--data_path reads {given} twice, {where}: its rows would be trained twice per epoch; "
                            f"give it once (a weight, {earlier.spec}:2, gives a source a larger share of a mixture; "
                            "--epochs adds passes)")


def lone_weight_note(sources: list[Source]) -> str | None:
    """A line for a single source given a weight (``eval.jsonl:2``, as an error names a line): the
    weight changes nothing, and it is no line number."""
    if len(sources) != 1 or sources[0].weight == 1:
        return None
    weight = f"{sources[0].weight:g}"
    return (f"[data] note: --data_path {sources[0].spec}:{weight}: ':{weight}' is a mixture weight, not a line "
            "number; a single source is read whole, every row once per epoch, whatever its weight")


def short_names(paths: list[str], fallback: str) -> list[str]:
    """Short, distinct names for files, directories or globs: the base name without its data
    suffixes (a glob's wildcards and the separators around them dropped; only wildcards: its
    directory's name)."""
    names = []
    for path in paths:
        name = os.path.basename(os.path.normpath(path))
        for suffix in (".gz", ".jsonl", ".json", ".parquet"):
            if name.lower().endswith(suffix):
                name = name[: -len(suffix)]
        if is_glob(path):
            name = "".join(char for char in name if char not in GLOB_CHARS + "]").strip("._- ") or os.path.basename(
                os.path.dirname(os.path.normpath(path)))
        base, number = name or fallback, 2
        while name in names or not name:
            name, number = f"{base}_{number}", number + 1
        names.append(name)
    return names


# --------------------------------------------------------------------------- counts per epoch


def epoch_counts(sizes: list[int], weights: list[float]) -> list[int]:
    """Samples of each source per epoch: the largest-remainder split of ``sum(sizes)`` in
    proportion to the weights (exact rational arithmetic; ties go to the earlier source)."""
    total = sum(sizes)
    exact = [Fraction(weight) for weight in weights]
    quotas = [total * weight / sum(exact) for weight in exact]
    counts = [math.floor(quota) for quota in quotas]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


class EpochMixture:
    """Which samples (indices into the sources laid end to end) an epoch holds; see the module doc."""

    def __init__(self, sizes: list[int], weights: list[float], seed: int):
        if len(sizes) != len(weights) or not sizes or min(sizes) < 1:
            raise ValueError(f"need a positive size and a weight per source, got sizes {sizes}, weights {weights}")
        self.sizes = [int(size) for size in sizes]
        self.weights = list(weights)
        self.seed = seed
        self.counts = epoch_counts(self.sizes, self.weights)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def members(self, epoch: int) -> np.ndarray:
        """The epoch's sample indices, source by source (full passes, then the epoch's share of
        the source's seeded cycle); the sampler shuffles them."""
        parts = []
        for source, (start, size, count) in enumerate(zip(self.starts, self.sizes, self.counts)):
            passes, extra = divmod(count, size)
            parts.append(start + np.tile(np.arange(size, dtype=np.int64), passes))
            if extra:
                cycle = np.random.default_rng([self.seed, source]).permutation(size)
                parts.append(start + cycle[(epoch * extra + np.arange(extra, dtype=np.int64)) % size])
        return np.concatenate(parts).astype(np.int64)


# --------------------------------------------------------------------------- datasets


class ConcatenatedSamples(Dataset):
    """Datasets laid end to end (the files of one source, or the sources of a mixture): ``lengths``,
    ``prompt_room``, ``item(index, capacity)`` and ``set_epoch`` as ``SFTDataset`` has them, so packing
    works on it."""

    def __init__(self, parts: list):
        self.parts = list(parts)
        self.starts = np.concatenate([[0], np.cumsum([len(part) for part in self.parts])]).astype(np.int64)
        self.lengths = np.concatenate([np.asarray(part.lengths, dtype=np.int64) for part in self.parts])
        rooms = [part.prompt_room for part in self.parts]  # one augmenter for all parts: all None or none
        self.prompt_room = None if rooms[0] is None else np.concatenate(rooms)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """(part, index inside that part) of a sample index."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        index = int(index) % len(self)
        part = int(np.searchsorted(self.starts, index, side="right")) - 1
        return part, index - int(self.starts[part])

    def set_epoch(self, epoch: int) -> None:
        for part in self.parts:
            part.set_epoch(epoch)

    def item(self, index: int, capacity: int) -> dict[str, np.ndarray]:
        part, local = self.locate(index)
        return self.parts[part].item(local, capacity)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        part, local = self.locate(index)
        return self.parts[part][local]


class MixtureDataset(ConcatenatedSamples):
    """The training sources laid end to end; every item carries ``source``, its source's number."""

    def __init__(self, parts: list, names: list[str]):
        super().__init__(parts)
        self.names = list(names)

    def __getitem__(self, index: int) -> dict:
        part, local = self.locate(index)
        return {**self.parts[part][local], "source": part}
