"""Reading a sharded checkpoint (`step_*.dcp/`, trainer/checkpoint/sharded.py) without running code stored
in it. DCP's own reader and planner unpickle two things with Python's full unpickler: the index
(`.metadata`, `FileSystemReader.read_metadata`) and the non-tensor entries of the shards (the optimizer's
lr, betas, ...: `DefaultLoadPlanner.load_bytes`). Here, through DCP's extension points:

- `SafeReader` reads `.metadata` with an unpickler that resolves only the globals a DCP index holds
  (`INDEX_GLOBALS`): DCP's metadata dataclasses, torch.Size, torch's dtypes and layouts, a path;
- `SafeLoadPlanner` reads each non-tensor entry with `torch.load(weights_only=True)`.

Anything else is refused with a one-line CheckpointError naming the file ("... may be malicious"), as
a single-file checkpoint that holds Python objects is (trainer/checkpoint/files.py). DCP reads the
tensors themselves with `torch.load(weights_only=True)`.
"""

import io
import os
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from trainer.checkpoint.files import names_a_forbidden_object
from trainer.errors import CheckpointError, first_line

INDEX = ".metadata"
MALICIOUS = "it is not a minisft checkpoint and may be malicious"
# What the pickle of a DCP index refers to: the globals of the indexes of this project's saves, by one
# process or sharded over several (tests/trainer/checkpoint/test_sharded.py, tests/trainer/parallel/
# test_fsdp.py read them back). DCP's dataclasses, built field by field; torch.Size, built from a
# tuple; a dtype; a layout, looked up by its name; the memory format, an enum; the path the checkpoint
# was written to (pickled from pathlib._local by Python 3.13). Calling or building any of them runs no
# code of the file's choosing.
INDEX_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    *(("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),
})


class ForbiddenGlobal(pickle.UnpicklingError):
    """A global that a DCP index does not hold: constructing or calling it could run code."""

    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.qualified = f"{module}.{name}"


class IndexUnpickler(pickle.Unpickler):
    """Python's unpickler, resolving only `INDEX_GLOBALS` (persistent ids it refuses as it is)."""

    def find_class(self, module: str, name: str):
        if (module, name) not in INDEX_GLOBALS:
            raise ForbiddenGlobal(module, name)
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's reader of a checkpoint directory whose `read_metadata` unpickles only what an index holds.
    minisft's saves are collective, so the index is always the one `.metadata`: DCP's `rank` for a
    rank's own index is not looked at."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = os.path.join(self.path, INDEX)
        with open(path, "rb") as handle:
            try:
                metadata = IndexUnpickler(handle).load()
            except ForbiddenGlobal as error:
                raise CheckpointError(f"refused to load {path}: it contains Python objects ({error.qualified}) that a "
                                      f"safe load of DCP's index does not allow; {MALICIOUS}") from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's reader: the load's id goes with it
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner of a load whose non-tensor entries are read with `torch.load(weights_only=True)`.
    `checkpoint`: the checkpoint directory, named in the errors."""

    def __init__(self, checkpoint: str, **options):
        super().__init__(**options)
        self.checkpoint = checkpoint

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """The entry read safely. DCP's own `load_bytes` then puts it in place (the flattening of the state
        dict stays DCP's), given a `torch.save` of what the safe load returned: tensors and plain values
        written by this process, not the file's bytes."""
        entry = read_item.dest_index.fqn
        shard = self.metadata.storage_data[read_item.storage_index].relative_path
        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - torch raises many types for damaged bytes
            unpickling = isinstance(error, pickle.UnpicklingError)
            if unpickling and names_a_forbidden_object(str(error)):
                raise CheckpointError(f"refused to load {os.path.join(self.checkpoint, shard)}: its entry {entry} holds "
                                      f"Python objects that a safe (weights_only) load does not allow; {MALICIOUS}") from None
            damage = "no value torch.save wrote" if unpickling else f"{type(error).__name__}: {first_line(error, 160)}"
            raise CheckpointError(f"sharded checkpoint {self.checkpoint} is unreadable ({shard}, entry {entry}: "
                                  f"{damage})") from None
        clean = io.BytesIO()
        torch.save(loaded, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def read_index(path: str) -> Metadata:
    """DCP's index of the checkpoint directory `path`, through `SafeReader`; a refused or damaged one is
    a one-line CheckpointError."""
    try:
        return SafeReader(path).read_metadata()
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - a damaged .metadata fails its unpickling in many ways
        raise CheckpointError(f"sharded checkpoint {path} is unreadable ({INDEX}: {first_line(error, 160)})") from None


def load_quietly(state: dict, no_dist: bool, path: str) -> None:
    """`dcp.load` of the checkpoint directory `path` into `state` through `SafeReader` and `SafeLoadPlanner`,
    without DCP's warning that torch.distributed is off (a load in one process is what `no_dist` means
    here). The index is read first (`read_index`): one that is refused is that one line, not DCP's
    logged tracebacks. A CheckpointError of the reader or planner (a refusal, a damaged entry) is
    raised as it is, not in DCP's summary of the ranks' failures."""
    read_index(path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, no_dist=no_dist, storage_reader=SafeReader(path), planner=SafeLoadPlanner(path))
    except CheckpointException as error:
        own = [cause for _, (cause, _) in sorted(error.failures.items()) if isinstance(cause, CheckpointError)]
        if own:
            raise own[0] from None
        raise


def check_entries(path: str, metadata: Metadata) -> None:
    """Read every non-tensor entry of the sharded checkpoint `path` (`metadata`: its index) as its load
    will: one that holds Python objects makes the checkpoint unusable here, where the newest usable one
    is chosen, not in the middle of the load."""
    entries = {key: None for key, item in metadata.state_dict_metadata.items() if isinstance(item, BytesStorageMetadata)}
    if not entries:
        return
    try:
        load_quietly(entries, True, path)
    except CheckpointError:
        raise
    except (CheckpointException, OSError, RuntimeError, ValueError) as error:
        raise CheckpointError(f"sharded checkpoint {path} is unreadable ({first_line(error, 200)})") from None
