"""A real malicious pickle: unpickling it runs a shell command (it creates a marker file)."""

import os

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
