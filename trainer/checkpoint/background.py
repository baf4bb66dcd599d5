"""Saves off the training loop's critical path: the state is copied to host memory (the step loop
waits only for that copy), and a writer thread writes the files while training goes on.

- `to_host(tree, into)`: every tensor of a nested dict/list (state dicts, optimizer state, RNG
  states) copied into one block of CPU memory (trainer/checkpoint/host_memory.py), the previous
  save's where the layout is the same; from a GPU into page-locked memory, copied asynchronously
  (the writer waits for the copies, the loop does not). The copy is what the files hold: later
  steps change the live tensors, never the copy.
- `host_model(config, state, source)`: a plain model around such a copy (and a `to_host` copy of
  the live model's RoPE tables), for the writers of inference weights, which read a model (its
  config, `state_dict()`, `save_pretrained`).
- `BackgroundWriter`: runs one job at a time in a thread, on the CUDA device of the thread that
  submits it; `submit` first waits for the previous job, so saves never overlap and the next one
  writes after the last; `wait` returns the one-line reason a job's write failed (a
  `CheckpointError`), which the caller reports on every rank.

The files keep every promise of a synchronous save: each is written under a temporary name and
renamed into place (a kill -9 mid-write leaves the previous checkpoint loadable), rotation runs after
the write, and the --save_dir lock is held until the last write has finished (`wait` before exit).
"""

from __future__ import annotations

import threading

import torch

from trainer.checkpoint.host_memory import host_tensors
from trainer.errors import CheckpointError


def to_host(tree, into=None, dtype: torch.dtype | None = None):
    """`tree` with every tensor copied to CPU memory (trainer/checkpoint/host_memory.py: one block,
    page-locked for CUDA tensors); other values kept.

    `into`: an earlier copy of a tree of the same layout (the previous save's, written already):
    when every tensor of it has the shape and dtype of its place in `tree`, they are filled again
    instead of allocating new ones, so a save does not touch fresh memory (page faults, pinned
    allocations) for every byte.
    `dtype`: the floating-point tensors' dtype in the copy (--save_dtype). Each tensor is cast as
    it is copied, so the device holds one cast tensor at a time, never a cast copy of the whole tree.
    Entries that are the same memory (a tied `lm_head.weight` and the embedding: two `detach()`ed
    views in a state dict) get one copy, so the copy and the file written from it hold it once."""
    sources: dict = {}  # memory key -> (the tensor, the earlier copy at its first place)
    _collect(tree, into, sources)
    wanted = [dtype if dtype is not None and source.is_floating_point() else source.dtype
              for source, _ in sources.values()]
    earlier = [old for _, old in sources.values()]
    if not all(isinstance(old, torch.Tensor) and old.shape == source.shape and old.dtype == want
               for (source, old), want in zip(sources.values(), wanted)):
        pin = torch.cuda.is_available() and any(source.is_cuda for source, _ in sources.values())
        earlier = host_tensors([(source.shape, want) for (source, _), want in zip(sources.values(), wanted)], pin)
    for (source, _), copy in zip(sources.values(), earlier):
        source = source.detach()
        if source.device.type == "cpu":
            copy.copy_(source)
        else:
            # Cast on the device, then copy: the cast tensor is freed once the copy is queued (the
            # allocator reuses its memory only for work queued after the copy on this stream).
            copy.copy_(source.to(copy.dtype), non_blocking=True)
    return _rebuild(tree, dict(zip(sources, earlier)))


def _collect(tree, into, sources: dict) -> None:
    """Every tensor of `tree` under its memory key (the first place it appears), with the tensor at
    the same place in `into`, if any."""
    if isinstance(tree, torch.Tensor):
        sources.setdefault(_memory_key(tree), (tree, into))
    elif isinstance(tree, dict):
        earlier = into if isinstance(into, dict) else {}
        for key, value in tree.items():
            _collect(value, earlier.get(key), sources)
    elif isinstance(tree, (list, tuple)):
        earlier = into if isinstance(into, (list, tuple)) and len(into) == len(tree) else [None] * len(tree)
        for value, old in zip(tree, earlier):
            _collect(value, old, sources)


def _rebuild(tree, copies: dict):
    """`tree` with each tensor replaced by the copy of its memory key."""
    if isinstance(tree, torch.Tensor):
        return copies[_memory_key(tree)]
    if isinstance(tree, dict):
        return type(tree)((key, _rebuild(value, copies)) for key, value in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebuild(value, copies) for value in tree)
    return tree


def _memory_key(tensor: torch.Tensor):
    """`same_memory_key`, or the tensor itself for an empty tensor (copied on its own)."""
    return same_memory_key(tensor) or ("empty", id(tensor))


def same_memory_key(tensor: torch.Tensor):
    """What two views of the same elements share: their storage (the C++ object, as torch.save tells
    shared storages apart; also for fake and meta tensors, which have no addresses), where in it
    they start, their shape, strides and dtype. None for an empty tensor."""
    if tensor.numel() == 0:
        return None
    return (tensor.untyped_storage()._cdata, tensor.storage_offset(), tensor.dtype, tuple(tensor.shape),
            tuple(tensor.stride()))


def copies_done() -> "torch.cuda.Event | None":
    """An event the writer waits on before it reads the host copies (None on a CPU-only run)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def host_model(config, state: dict, source):
    """A MiniMindForCausalLM whose weights are the host tensors `state` (nothing is copied again),
    with the non-persistent buffers (RoPE tables) of `source`, the live model, copied by `to_host`:
    from a GPU queued into pinned memory, so a save never waits here for the GPU's queued work (the
    writer waits for `copies_done`; the files hold no non-persistent buffer)."""
    from model import MiniMindForCausalLM

    with torch.device("meta"):
        plain = MiniMindForCausalLM(config)
    plain.load_state_dict(state, assign=True, strict=False)
    for name, buffer in list(plain.named_buffers()):
        if buffer.is_meta:  # non-persistent buffers are not in the state dict
            module_name, _, attr = name.rpartition(".")
            owner = plain.get_submodule(module_name) if module_name else plain
            origin = source.get_submodule(module_name) if module_name else source
            owner.register_buffer(attr, to_host(getattr(origin, attr)), persistent=False)
    if plain.config.tie_word_embeddings:
        plain.tie_weights()
    return plain.eval()


class BackgroundWriter:
    """One writer thread at a time; its failure is kept for the next `wait`."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.buffers: dict = {}  # the last host copies, refilled by the next save once written; its tokenizer

    def submit(self, job, ready: "torch.cuda.Event | None" = None) -> str | None:
        """Wait for the previous job (returns its failure, and then does not start `job`), then run
        `job()` in a thread once `ready` (the host copies) has completed."""
        failure = self.wait()
        if failure:
            return failure
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self.thread = threading.Thread(target=self._run, args=(job, ready, device), name="minisft-checkpoint-writer")
        self.thread.start()
        return None

    def _run(self, job, ready, device: int | None) -> None:
        """`job` on `device`, the submitting thread's CUDA device: a new thread's current device is GPU 0
        whatever its process's, and a CUDA call there would make a context on GPU 0."""
        try:
            if device is not None:
                torch.cuda.set_device(device)
            if ready is not None:
                ready.synchronize()
            job()
        except BaseException as error:  # noqa: BLE001 - reported by wait() on the training thread
            self.failure = error

    def wait(self) -> str | None:
        """Block until the running job (if any) has finished. Returns the one-line reason of a failed
        write; a failure that is not a CheckpointError (a bug) is raised here with its traceback."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        failure, self.failure = self.failure, None
        if failure is None:
            return None
        if isinstance(failure, CheckpointError):
            return str(failure)
        raise failure

    def join(self) -> None:
        """Let the running write finish, whatever its result: a run that stops on an error still
        leaves the checkpoint it was writing complete."""
        if self.thread is not None:
            self.thread.join()
