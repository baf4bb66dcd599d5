"""Reads of device values on the host, counted on any machine (a CPU included).

`HostReads` is a dispatch mode that marks every tensor computed from the model's parameters and
buffers or the optimizer's state (so: activations, the loss, gradients, the gradient norm, the
optimizer's flags, whatever the loop derives from them) and records each place where such a
tensor is turned into a host value: `.item()`, `bool()`, `int()`, `float()` (aten's
`_local_scalar_dense`), `.tolist()`, `.numpy()`, `.cpu()`, or fed to an op whose result's size
depends on its values (`nonzero`, indexing by a boolean mask, `masked_select`, `unique`, ...). On a
GPU each of those waits for the device. Tensors the host made itself (the CPU batch, the counts computed
from it) are not marked; `mark` marks more (evaluation: what `model_inputs` puts on the device),
`on_the_device` the inputs a training step moves there.
"""

import copy
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from scripts._dispatch_counts import written_arguments
from tests.helpers.trainer_launch import REPO

# `cpu`: on a GPU a blocking copy to the host; on the CPU the tensor itself, which no op dispatch sees
HOST_READ_METHODS = ("tolist", "numpy", "cpu")
aten = torch.ops.aten
# Ops that read a value on the host or size their result by the data: each a host sync on a GPU.
SYNCING_OPS = {
    aten._local_scalar_dense.default: "item",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.equal.default: "equal",
    aten.bincount.default: "bincount",
}
# Indexing ops that sync when an index is a boolean mask (x[mask], x[mask] = v).
MASKABLE_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def caller() -> str:
    """The innermost frame of this repository's code outside tests/ and installed packages: file:line in function."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(REPO) and "/tests/" not in name and "site-packages" not in name:  # a .venv inside the repo is not ours
            return f"{name[len(REPO) + 1:]}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def syncing_op(func, args, kwargs) -> str | None:
    """What a call of `func` reads on the host, as a read is named, or None."""
    if func in SYNCING_OPS:
        return SYNCING_OPS[func]
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave"
    if func in MASKABLE_OPS and any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
                                    for index in args[1]):
        return "index by mask"
    return None


class HostReads(TorchDispatchMode):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        super().__init__()
        self.marked = WeakIdKeyDictionary()
        self.reads: list[str] = []
        for tensor in [*model.parameters(), *model.buffers()]:
            self.mark(tensor)
        for state in optimizer.state.values() if optimizer is not None else []:
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.mark(value)
        self.originals = {name: getattr(torch.Tensor, name) for name in HOST_READ_METHODS}

    def mark(self, tensor: torch.Tensor) -> None:
        self.marked[tensor] = True
        # a DTensor's shard; the tensor a view (written in place) looks into
        for other in (getattr(tensor, "_local_tensor", None), tensor._base):
            if other is not None:
                self.marked[other] = True

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
        if tainted:
            name = syncing_op(func, args, kwargs)
            if name:
                self.reads.append(f"{name} at {caller()}")
        out = func(*args, **kwargs)
        if tainted:  # what the op returns or writes in place (sums[:3] = marked) is marked
            for value in tree_leaves((out, written_arguments(func, args, kwargs))):
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

    def on_the_device(self, model_inputs):
        """`model_inputs` whose tensors are copies, marked: on a GPU they are the device's, so a host read
        of one waits for the device. On the CPU `.to` returns the batch's own tensors, which the host
        reads freely (the loop counts its tokens there), so each is copied before it is marked; of a
        packed layout only `cu_seqlens` goes to the device (model/packed_attention.py)."""
        def moved(batch, device):
            inputs = {}
            for key, value in model_inputs(batch, device).items():
                if hasattr(value, "cu_seqlens"):
                    value = copy.copy(value)
                    value.cu_seqlens = value.cu_seqlens.clone()
                    self.mark(value.cu_seqlens)
                else:
                    value = value.clone()
                    self.mark(value)
                inputs[key] = value
            return inputs

        return moved

    def during(self, action):
        """The reads that `action()` makes."""
        self.reads = []
        with self:
            action()
        return self.reads
