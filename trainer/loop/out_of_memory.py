"""A device that runs out of memory during a step, an evaluation or a save: told apart from other
errors, and said in one line with what the run holds and the flags that change it.

`run` is the loop's Run (trainer/loop/state.py), left unannotated: state.py reads this module's
messages, and the imports point one way."""

import contextlib

import torch

from trainer.errors import TrainingError, first_line


# What torch's CPU allocator says when the memory it asks for cannot be had (a plain RuntimeError,
# where a GPU's caching allocator raises torch.OutOfMemoryError).
CPU_ALLOCATOR_FAILURE = "DefaultCPUAllocator: can't allocate memory"


def ran_out_of_memory(error: RuntimeError) -> bool:
    """Whether `error` is a device running out of memory: a GPU's, or the CPU allocator's."""
    return isinstance(error, torch.OutOfMemoryError) or CPU_ALLOCATOR_FAILURE in str(error)


@contextlib.contextmanager
def one_line_if_out_of_memory(run, what: str, training: bool = True):
    """Work on a batch (`what`: "step N", or "the evaluation at step N" with `training` False): where
    the device runs out of memory inside, the one-line TrainingError of `out_of_memory`; any other
    error goes on as it is."""
    try:
        yield
    except RuntimeError as error:
        if not ran_out_of_memory(error):
            raise
        raise TrainingError(out_of_memory(run, error, what, training)) from None


def out_of_memory(run, error: RuntimeError, what: str, training: bool = True) -> str:
    """`what` (a training step, an evaluation) ran out of device memory: what the allocator asked for
    and had, and the flags that set the memory of a batch, in one line instead of the allocator's
    paragraph and a traceback. Gradient checkpointing helps a training step only."""
    args = run.args
    checkpointing = ", or give --gradient_checkpointing 1" if training and not args.gradient_checkpointing else ""
    return (f"{what} ran out of memory on {run.ctx.device} ({allocator_summary(error)}): a batch's activations "
            f"grow with --batch_size {args.batch_size} x --max_seq_len {args.max_seq_len}; lower --batch_size "
            f"(raise --accumulation_steps to keep the batch per step){',' if checkpointing else ' or'} lower "
            f"--max_seq_len{checkpointing}")


def save_out_of_memory(run, error: torch.OutOfMemoryError, what: str) -> str:
    """A save ran out of device memory beside the weights and optimizer state training holds: it
    holds one weight at a time on the device, cast to --save_dtype (trainer/checkpoint/background.py),
    or under --fsdp 1 gathered in full. Nothing of this save was written; the files already in
    --save_dir stay as they are. Activations are freed by then, so no batch flag helps."""
    args = run.args
    if run.parallel.checkpoint_kind == "sharded":  # --fsdp 1 on several processes
        holds, advice = "each weight gathered in full, one at a time", ""
    else:
        holds = f"one weight at a time cast to --save_dtype {args.save_dtype}"
        advice = "" if args.save_dtype == "float32" else "--save_dtype float32 casts none; "
    return (f"{what} at step {run.state.step} ran out of memory on {run.ctx.device} ({allocator_summary(error)}): "
            f"a save holds {holds} on the device beside the weights and optimizer state; {advice}"
            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lessens fragmentation. The files already in "
            f"{args.save_dir} are kept")


def resume_out_of_memory(device: torch.device, error: RuntimeError) -> str:
    """Loading a resume checkpoint's optimizer state (AdamW's two moments, 8 bytes a parameter) onto
    the device ran out of its memory beside the weights already there: the model fits the device's
    whole memory (`check_gpu_memory`, `check_host_memory`), so something else holds the rest. A GPU's
    holder shows in nvidia-smi, and --fsdp 1 over more GPUs shards the state; a CPU's processes share
    the host's memory, so more of them on it shard nothing."""
    gpu = device.type == "cuda"
    viewer, shard = ("nvidia-smi", ", or train with more processes and --fsdp 1 to shard them") if gpu else ("top", "")
    return (f"loading the resume checkpoint's optimizer state ran out of memory on {device} "
            f"({allocator_summary(error)}): the weights, their gradients and AdamW's moments need about 16 bytes "
            f"a parameter there; another process may hold the rest of its memory ({viewer} shows which){shard}")


def allocator_summary(error: RuntimeError) -> str:
    """The CUDA caching allocator's sentences up to the free memory ("CUDA out of memory. Tried to
    allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free."), not its
    breakdown and advice; the CPU allocator's from "DefaultCPUAllocator" on; another message's first
    sentences within 300 characters."""
    text = first_line(error, limit=1000)
    if CPU_ALLOCATOR_FAILURE in text:  # after the allocator's "[enforce fail at alloc_cpu.cpp:N] err == 0."
        text = text[text.index(CPU_ALLOCATOR_FAILURE):]
    for tail in (" Including non-PyTorch memory", " Of the allocated memory"):
        text = text.split(tail)[0]
    if len(text) > 300:
        text = text[:300].rsplit(". ", 1)[0] + "."
    return text
