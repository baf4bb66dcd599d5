"""Reads of device values on the host, counted on any machine (a CPU included).

`HostReads` is a dispatch mode that marks every tensor computed from the model's parameters and
buffers or the optimizer's state (so: activations, the loss, gradients, the gradient norm, the
optimizer's flags, whatever the loop derives from them) and records each place where such a
tensor is turned into a host value: `.item()`, `bool()`, `int()`, `float()` (aten's
`_local_scalar_dense`), `.tolist()`, `.numpy()`. On a GPU each of those waits for the device.
Tensors the host made itself (the CPU batch, the counts computed from it) are not marked.
"""

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from tests.helpers.trainer_launch import REPO

HOST_READ_METHODS = ("tolist", "numpy")


def caller() -> str:
    """The innermost frame of this repository's code outside tests/ and installed packages: file:line in function."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(REPO) and "/tests/" not in name and "site-packages" not in name:  # a .venv inside the repo is not ours
            return f"{name[len(REPO) + 1:]}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class HostReads(TorchDispatchMode):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.marked = WeakIdKeyDictionary()
        self.reads: list[str] = []
        for tensor in [*model.parameters(), *model.buffers()]:
            self.mark(tensor)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.mark(value)
        self.originals = {name: getattr(torch.Tensor, name) for name in HOST_READ_METHODS}

    def mark(self, tensor: torch.Tensor) -> None:
        self.marked[tensor] = True
        local = getattr(tensor, "_local_tensor", None)  # a DTensor's shard
        if local is not None:
            self.marked[local] = True

    def is_marked(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor in self.marked

    def _watched(self, original, name):
        def read(tensor, *args, **kwargs):
            if self.is_marked(tensor):
                self.reads.append(f"{name} at {caller()}")
            return original(tensor, *args, **kwargs)

        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tree_leaves((args, kwargs))
        tainted = any(self.is_marked(value) for value in inputs)
        if tainted and func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(f"item at {caller()}")
        out = func(*args, **kwargs)
        if tainted:
            for value in tree_leaves(out):
                if isinstance(value, torch.Tensor):
                    self.mark(value)
        return out

    def __enter__(self):
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, self._watched(original, name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def during(self, action):
        """The reads that `action()` makes."""
        self.reads = []
        with self:
            action()
        return self.reads
