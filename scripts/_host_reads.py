"""Reads of device values on the host, counted on any machine (a CPU included).

`HostReads` is a dispatch mode that marks every tensor computed from the model's parameters and
buffers or the optimizer's state (so: activations, the loss, gradients, the gradient norm, the
optimizer's flags, whatever the loop derives from them) and records each place where such a
tensor is turned into a host value: `.item()`, `bool()`, `int()`, `float()` (aten's
`_local_scalar_dense`), `.tolist()`, `.numpy()`, `.cpu()`, or fed to an op whose result's size
depends on its values (`nonzero`, indexing by a boolean mask, `masked_select`, `unique`, ...). On a
GPU each of those waits for the device. Tensors the host made itself (the CPU batch, the counts
computed from it) are not marked; `mark` marks more: `mark_device_inputs` what `model_inputs` puts on
the device from a batch, `on_the_device` the device's copies of a training step's inputs.
scripts/step_figures.py counts a step's reads with it; the tests of the loop, the evaluation and the
loss scale check theirs.
"""

import copy
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from dataset.collate import model_inputs

REPO = str(Path(__file__).resolve().parents[1])

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


def written_arguments(func, args, kwargs) -> list:
    """The arguments op `func` writes in place, by its schema (`self` of `copy_`, `out=`, the lists
    of `_foreach_add_`); an argument not given is None."""
    given = {**dict(zip((a.name for a in func._schema.arguments), args)), **kwargs}
    return [given.get(a.name) for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def caller() -> str:
    """The innermost frame of this repository's code outside tests/, this module and installed packages:
    file:line in function."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        # a .venv inside the repo is not ours
        if name.startswith(REPO) and "/tests/" not in name and "site-packages" not in name and name != __file__:
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

    def mark_device_inputs(self, batch: dict) -> None:
        """Mark what `model_inputs` moves to the device from the CPU `batch`."""
        self.mark_inputs(model_inputs(batch, torch.device("cpu")))

    def mark_inputs(self, inputs: dict) -> None:
        """Mark the model's `inputs` as the device's (of a packed layout the varlen kernel's
        `cu_seqlens`; its bucket plan stays on the host)."""
        for value in inputs.values():
            self.mark(value.cu_seqlens if hasattr(value, "cu_seqlens") else value)

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
        reads freely (the loop counts its tokens there), so each is copied before it is marked."""
        def copied(value):
            if hasattr(value, "cu_seqlens"):  # a packed layout: only `cu_seqlens` goes to the device
                value = copy.copy(value)
                value.cu_seqlens = value.cu_seqlens.clone()
                return value
            return value.clone()

        def moved(batch, device):
            inputs = {key: copied(value) for key, value in model_inputs(batch, device).items()}
            self.mark_inputs(inputs)
            return inputs

        return moved

    def during(self, action):
        """The reads that `action()` makes."""
        self.reads = []
        with self:
            action()
        return self.reads
