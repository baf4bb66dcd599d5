"""A save's host copies (trainer/checkpoint/host_memory.py, background.to_host): one block of the
exact sum of their sizes, each copy a storage of its own, so files written from them hold each
tensor once."""

import gc
import io

import pytest
import torch
from safetensors.torch import load, save

from trainer.checkpoint.background import to_host
from trainer.checkpoint.host_memory import ALIGN, host_tensors
from trainer.errors import TrainingError


def _tree():
    return {"w": torch.randn(1000), "b": torch.randn(3, 7).to(torch.bfloat16),
            "rng": [torch.arange(5, dtype=torch.uint8)], "step": torch.tensor(9), "none": torch.empty(0)}


def test_the_copies_lie_end_to_end_in_one_block_each_its_own_storage():
    """torch's pinned allocator rounds each allocation up to a power of two (a 1000-float tensor:
    4096 bytes for 4000); here the copies follow one another in one block, each at the next
    multiple of ALIGN bytes, and each storage is exactly its tensor's size."""
    tree = _tree()
    copy = to_host(tree)
    laid = [copy["w"], copy["b"], copy["rng"][0], copy["step"]]
    for source, copied in zip([tree["w"], tree["b"], tree["rng"][0], tree["step"]], laid):
        assert torch.equal(copied, source) and copied.dtype == source.dtype
        assert copied.untyped_storage().nbytes() == source.numel() * source.element_size()
    starts = [tensor.untyped_storage().data_ptr() for tensor in laid]
    assert [b - a for a, b in zip(starts, starts[1:])] == [4032, 64, 64]  # 4000, 42 and 5 bytes rounded to 64
    assert copy["none"].shape == (0,)
    assert ALIGN == 64


def test_files_written_from_the_copies_hold_each_tensor_once():
    """torch.save writes each storage whole and safetensors refuses tensors that share one: a copy
    made as a view of the block would write the block into every file, or fail."""
    tree = {key: value for key, value in _tree().items() if key != "rng"}
    copy = to_host(tree)
    written, expected = io.BytesIO(), io.BytesIO()
    torch.save(copy, written)
    torch.save({key: value.clone() for key, value in tree.items()}, expected)
    assert len(written.getvalue()) == len(expected.getvalue())
    loaded = load(save({key: value for key, value in copy.items() if value.numel()}))
    assert all(torch.equal(loaded[key], tree[key]) for key in loaded) and len(loaded) == 3


def test_a_cast_copy_is_laid_out_at_its_cast_size():
    copy = to_host({"a": torch.randn(40), "b": torch.randn(40)}, dtype=torch.bfloat16)
    assert copy["a"].dtype == torch.bfloat16 and copy["a"].untyped_storage().nbytes() == 80
    assert copy["b"].untyped_storage().data_ptr() - copy["a"].untyped_storage().data_ptr() == 128


class FakeCudart:
    """torch.cuda.cudart() as on a GPU machine: records what is page-locked and unlocked, and answers
    `error` (a CUDA error code, 0 = success) to cudaHostRegister."""

    def __init__(self, error: int = 0):
        self.calls, self.error = [], error

    def cudaHostRegister(self, address, size, flags):  # noqa: N802 - the CUDA runtime's name
        self.calls.append(("register", address, size, flags))
        return self.error

    def cudaHostUnregister(self, address):  # noqa: N802
        self.calls.append(("unregister", address))
        return 0


def test_the_block_of_gpu_copies_is_page_locked_once_and_unlocked_when_its_copies_are_freed(monkeypatch):
    """The copies of a GPU's tensors: one cudaHostRegister of the whole block (4000 and 42 bytes,
    each rounded to 64: 4096), at the first copy's address, default flags; one cudaHostUnregister
    of that address once the last copy is freed, not before."""
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    first, second = host_tensors([(torch.Size([1000]), torch.float32), (torch.Size([3, 7]), torch.bfloat16)], pin=True)
    address = first.data_ptr()
    assert cudart.calls == [("register", address, 4096, 0)]
    assert second.data_ptr() - address == 4032 and (first.shape, second.shape) == ((1000,), (3, 7))
    del first
    gc.collect()
    assert cudart.calls == [("register", address, 4096, 0)]  # the block lives while one of its copies does
    del second
    gc.collect()
    assert cudart.calls == [("register", address, 4096, 0), ("unregister", address)]
    host_tensors([(torch.Size([1000]), torch.float32)], pin=False)  # a CPU run's copies: nothing locked
    host_tensors([(torch.Size([0]), torch.float32)], pin=True)  # nothing to lock
    assert len(cudart.calls) == 2


def test_host_memory_that_cannot_be_page_locked_is_one_line_naming_the_size_and_the_cuda_error(monkeypatch):
    cudart = FakeCudart(error=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    with pytest.raises(TrainingError) as failure:
        host_tensors([(torch.Size([2**28]), torch.float32)], pin=True)
    assert str(failure.value) == ("could not page-lock 1.00 GiB of host memory for the save's copies "
                                  "(cudaHostRegister returned CUDA error 2)")
    assert [call[0] for call in cudart.calls] == ["register"]  # nothing registered: nothing to unlock
