"""The saves of the loop (step 7): the resume checkpoint, then the inference weights (`model/`, and
MiniMind's .pth with --save_weight), written by rank 0 in the background
(trainer/checkpoint/background.py) while training goes on.

A save costs the loop a copy of the state to host memory; the writer thread writes the files.
The next save first waits for the previous write; a write that failed (disk full, permissions)
stops every rank there, or at the end (`finish_saves`), with its one-line CheckpointError.
Under --fsdp 1 every rank copies its shard of the resume checkpoint to host memory and writes it in
the background with DCP's async_save (trainer/checkpoint/sharded.py); every rank's writer thread
waits for its write, and rank 0's then publishes the checkpoint and writes the gathered inference
weights.
"""

import copy

import torch

from trainer.checkpoint.background import copies_done, host_model, to_host
from trainer.errors import CheckpointError, TrainingError
from trainer.loop.state import Run, resume_state
from trainer.runtime.distributed import barrier, rank0_value
from trainer.weights.write import publish_inference_weights, save_minimind_copy


def raise_on_every_rank(error: str | TrainingError | None, what: str) -> None:
    """A write that failed on rank 0 (its one-line reason, or None) is raised on every rank, so no
    rank waits in the next collective for one that stopped: a CheckpointError, or the TrainingError
    rank 0 gives (a save out of device memory). The others wait for rank 0's outcome on the store,
    however long its write takes (`rank0_value`)."""
    agreed = rank0_value(None if error is None else [isinstance(error, TrainingError), str(error)], what)
    if agreed:
        training, message = agreed
        raise TrainingError(message, every_rank=True) if training else CheckpointError(message)


def save_in_background(run: Run) -> None:
    """Copy what this save writes to host memory and hand it to the writer (collective)."""
    args, main = run.args, run.ctx.is_main
    wait_for_last_write(run)
    content = resume_state(run)
    save_dtype = getattr(torch, args.save_dtype)
    shards = None  # --fsdp 1: the sharded checkpoint, being written by every rank
    if run.parallel.checkpoint_kind == "sharded":
        error = None
        try:
            shards = run.parallel.write_resume_checkpoint(content, args.save_dir, args.keep_last)
        except CheckpointError as failure:
            error = str(failure)
        content = None
        raise_on_every_rank(error if main else None, "starting the checkpoint's shard writes")
    weights = run.parallel.inference_model(save_dtype)  # collective under --fsdp 1 (then a host copy)
    if not main:
        if shards is not None:
            run.writer.submit(shards.wait)  # its failure is rank 0's as well, and rank 0 reports it
        return
    buffers = run.writer.buffers  # the previous save's copies: written, so free to fill again
    if weights is run.parallel.model:  # the live model: its weights copied, as the resume state
        earlier = buffers.get("weights", {})
        buffers["weights"] = to_host(weights.state_dict(), earlier, save_dtype)
        if any(value is not earlier.get(key) for key, value in buffers["weights"].items()):
            buffers["model"] = host_model(weights.config, buffers["weights"], run.parallel.model)
        weights = buffers["model"]  # around the buffers just filled (a model is built only for new ones)
    if content is not None:
        content = buffers["content"] = to_host(content, buffers.get("content"))
    if "tokenizer" not in buffers:  # the writer's own (a fast tokenizer is not to be shared by threads),
        buffers["tokenizer"] = copy.deepcopy(run.tokenizer)  # copied once: a large vocabulary takes ~0.3 s
    tokenizer = buffers["tokenizer"]

    def write() -> None:
        if shards is not None:
            written = shards.wait()
        else:
            written = run.parallel.write_resume_checkpoint(content, args.save_dir, args.keep_last)
        publish_inference_weights(weights, tokenizer, args.save_dir, save_dtype)
        if args.save_weight:  # MiniMind's habit: {save_dir}/{save_weight}_{hidden}[_moe].pth
            save_minimind_copy(weights, args.save_dir, args.save_weight)
        run.logger.print(f"saved {written}")

    run.writer.submit(write, copies_done())


def wait_for_last_write(run: Run) -> None:
    """Every rank waits for its writer (collective); a failed write is raised on every rank with rank
    0's one-line error (a sharded write that failed anywhere failed on rank 0 too)."""
    error = run.writer.wait()
    raise_on_every_rank(error if run.ctx.is_main else None, "writing the checkpoint")


def finish_saves(run: Run) -> None:
    """Wait for the last write (collective): the run ends only with its files complete, and a
    failed write ends it with its one-line error on every rank."""
    wait_for_last_write(run)
    barrier(run.ctx.device)
