"""Real malicious pickles, a torch file and a sharded checkpoint's index: unpickling them runs a shell
command (it creates a marker file)."""

import os
import pickle

import torch


class RunsCode:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def malicious_checkpoint(path, marker) -> None:
    """A file that looks like a minisft checkpoint but executes code when unpickled unsafely."""
    torch.save({"format": "minisft-resume", "format_version": 1, "payload": RunsCode(marker)}, path)


def malicious_dcp_index(checkpoint, marker) -> None:
    """The `.metadata` (DCP's index) of the sharded checkpoint `checkpoint`, still a real index of its
    shards, with a `RunsCode` among its entries: unpickled unsafely, it runs a shell command."""
    from torch.distributed.checkpoint import FileSystemReader

    index = os.path.join(checkpoint, ".metadata")
    metadata = FileSystemReader(checkpoint).read_metadata()  # the test's own, intact file
    metadata.storage_meta.modules = [RunsCode(marker)]
    with open(index, "wb") as handle:
        pickle.dump(metadata, handle)
