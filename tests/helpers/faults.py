"""Fault injection for tests: the real trainer with planted faults, started through this file.

    python tests/helpers/faults.py TRAINER_FLAGS ...                         # instead of train_full_sft.py
    python tests/helpers/faults.py --verify_equivalence TOOL_FLAGS ...      # scripts/verify_equivalence.py,
                                                                            # whose trainer runs are this file

The faults come from the environment (torchrun's workers and the equivalence tool's runs inherit it):

- MINISFT_FAULT_NAN_STEPS="3,4,5": the loss of those optimizer steps (numbered from 1, as in the
  logs) is NaN (tests/e2e/test_non_finite_loss.py);
- MINISFT_FAULT_OOM_STEP=3: that optimizer step runs out of GPU memory (`torch.OutOfMemoryError`
  with the CUDA caching allocator's message), as a batch too large for the GPU does; with
  MINISFT_FAULT_OOM_EVAL_STEP=2 the evaluation at that step does, with MINISFT_FAULT_OOM_SAVE_STEP=4
  the save at that step, with MINISFT_FAULT_OOM_BEST=1 the first write of best/, with
  MINISFT_FAULT_OOM_LAYOUT=1 the model's forward in the first forward and backward of several
  processes, which settles DDP's gradient layout before step 1 (tests/e2e/test_non_finite_loss.py);
- MINISFT_FAULT_CPU_OOM_STEP=3: that optimizer step asks torch's CPU allocator for more memory than
  any machine has (a real allocation, which fails as a batch too large for the host's memory does);
- MINISFT_FAULT_FILE_LIMIT="4:262144": from the save at that optimizer step on, once the saves
  before it are written, no file of the process may grow past that many bytes (RLIMIT_FSIZE: the
  write fails with EFBIG, "File too large", as on a full disk; tests/e2e/test_disk_faults.py);
- MINISFT_FAULT_GPU_MEMORY_MIB=16: the caching allocator of GPU 0 is capped at that much, so a
  real step runs out of memory on a real GPU (tests/test_cuda.py);
- MINISFT_FAULT_LOCAL_MEAN=1: the classic normalisation bug, every rank divides its token loss
  by its OWN loss-token count instead of the step's global count, so DDP averages per-rank means
  and N ranks x B no longer equal 1 rank x N*B (tests/scripts/test_verify_equivalence.py).

The trainer has no hook for them: `install` wraps two functions of trainer/loop/loop.py, the one
place the faults enter.
"""

import os
import resource
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

NAN_STEPS_ENV = "MINISFT_FAULT_NAN_STEPS"
LOCAL_MEAN_ENV = "MINISFT_FAULT_LOCAL_MEAN"
OOM_STEP_ENV = "MINISFT_FAULT_OOM_STEP"
OOM_EVAL_STEP_ENV = "MINISFT_FAULT_OOM_EVAL_STEP"
OOM_SAVE_STEP_ENV = "MINISFT_FAULT_OOM_SAVE_STEP"
OOM_BEST_ENV = "MINISFT_FAULT_OOM_BEST"
OOM_LAYOUT_ENV = "MINISFT_FAULT_OOM_LAYOUT"
CPU_OOM_STEP_ENV = "MINISFT_FAULT_CPU_OOM_STEP"
GPU_MEMORY_ENV = "MINISFT_FAULT_GPU_MEMORY_MIB"
FILE_LIMIT_ENV = "MINISFT_FAULT_FILE_LIMIT"
# What the CUDA caching allocator raises: one line
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the "
            "allocated memory 74.50 GiB is allocated by PyTorch, and 2.96 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
            "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


def nan_steps() -> frozenset[int]:
    text = os.environ.get(NAN_STEPS_ENV, "")
    return frozenset(int(part) for part in text.split(",") if part.strip())


def poison_loss(module, inputs, out):
    """A forward hook: the model's loss times NaN (its gradients follow)."""
    out.loss = out.loss * float("nan")
    return out


def out_of_memory() -> None:
    """Raise what the CUDA caching allocator raises for a request that does not fit."""
    import torch

    raise torch.OutOfMemoryError(CUDA_OOM)


def install() -> None:
    """Wrap trainer/loop/loop.py's `optimizer_step` (NaN steps, out of memory), `evaluate`,
    `save_in_background` (out of memory, a file size limit), `publish_inference_weights` and
    `settle_gradient_layout` (out of memory) and `agree_on_step` (local mean); cap GPU 0's memory."""
    from trainer.loop import loop
    from trainer.loop.saves import wait_for_last_write

    steps, local_mean = nan_steps(), os.environ.get(LOCAL_MEAN_ENV) == "1"
    oom_step = int(os.environ.get(OOM_STEP_ENV, "0"))
    oom_eval_step = int(os.environ.get(OOM_EVAL_STEP_ENV, "0"))
    oom_save_step = int(os.environ.get(OOM_SAVE_STEP_ENV, "0"))
    cpu_oom_step = int(os.environ.get(CPU_OOM_STEP_ENV, "0"))
    limit_step, _, limit = os.environ.get(FILE_LIMIT_ENV, "0:0").partition(":")
    limit_step, limit = int(limit_step), int(limit)
    real_step, real_agree, real_evaluate = loop.optimizer_step, loop.agree_on_step, loop.evaluate
    oom_best = os.environ.get(OOM_BEST_ENV) == "1"
    real_save, real_publish = loop.save_in_background, loop.publish_inference_weights
    real_settle = loop.settle_gradient_layout

    def optimizer_step(run, *args, **kwargs):
        if run.state.step + 1 == oom_step:
            out_of_memory()
        if run.state.step + 1 == cpu_oom_step:
            import torch

            torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: more than any address space holds
        if run.state.step + 1 not in steps:
            return real_step(run, *args, **kwargs)
        handle = run.model.register_forward_hook(poison_loss)
        try:
            return real_step(run, *args, **kwargs)
        finally:
            handle.remove()

    def evaluate(run):
        if run.state.step == oom_eval_step:
            out_of_memory()
        return real_evaluate(run)

    def save_in_background(run):
        if run.state.step == oom_save_step:
            out_of_memory()
        if run.state.step == limit_step:
            wait_for_last_write(run)  # the saves before are complete: only this one meets the limit
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        return real_save(run)

    def publish_inference_weights(model, tokenizer, save_dir, dtype, **kwargs):  # best/ in loop.py
        if kwargs.get("name") == "best":
            out_of_memory()
        return real_publish(model, tokenizer, save_dir, dtype, **kwargs)

    def settle_gradient_layout(run, batch):  # a forward there runs only with several processes (DDP)
        handle = run.raw_model.register_forward_pre_hook(lambda *_: out_of_memory())
        try:
            return real_settle(run, batch)
        finally:
            handle.remove()

    def agree_on_step(run, micro_batches, *args, **kwargs):
        totals = real_agree(run, micro_batches, *args, **kwargs)
        # x world_size (the loop's undoing of DDP's average) then gives sum / local count
        local = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in micro_batches)
        return totals._replace(loss_tokens=local * run.ctx.world_size)

    if steps or oom_step or cpu_oom_step:
        loop.optimizer_step = optimizer_step
    if os.environ.get(GPU_MEMORY_ENV):
        import torch

        cap = int(os.environ[GPU_MEMORY_ENV]) << 20
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory, 0)
    if local_mean:
        loop.agree_on_step = agree_on_step
    if oom_eval_step:
        loop.evaluate = evaluate
    if oom_save_step or limit_step:
        loop.save_in_background = save_in_background
    if oom_best:
        loop.publish_inference_weights = publish_inference_weights
    if os.environ.get(OOM_LAYOUT_ENV) == "1":
        loop.settle_gradient_layout = settle_gradient_layout


IN_PROCESS = (NAN_STEPS_ENV, OOM_STEP_ENV, OOM_EVAL_STEP_ENV, OOM_SAVE_STEP_ENV, OOM_BEST_ENV, CPU_OOM_STEP_ENV,
              OOM_LAYOUT_ENV)
WRAPPED = ("optimizer_step", "agree_on_step", "evaluate", "save_in_background", "publish_inference_weights",
           "settle_gradient_layout")


def run_in_this_process(args: list[str], **faults: str):
    """`python tests/helpers/faults.py ARGS` with `faults` in its environment, run in the test's process
    (`run_trainer_in_process`): for one-process runs whose process is not what a test checks. Only
    the faults that end with the run (IN_PROCESS: not a file size limit, not a GPU's memory cap);
    the wrapped functions of trainer/loop/loop.py are put back after the run."""
    from tests.helpers.trainer_launch import run_trainer_in_process
    from trainer.loop import loop

    assert set(faults) <= set(IN_PROCESS), faults
    real, environ = {name: getattr(loop, name) for name in WRAPPED}, dict(os.environ)
    try:
        os.environ.update(faults)
        install()
        return run_trainer_in_process(args)
    finally:
        os.environ.clear()
        os.environ.update(environ)
        for name, function in real.items():
            setattr(loop, name, function)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--verify_equivalence"]:
        from scripts import verify_equivalence
        from scripts._common import run_main

        verify_equivalence.TRAINER = os.path.abspath(__file__)
        sys.argv = [verify_equivalence.__file__, *argv[1:]]
        run_main(verify_equivalence.main)
        return 0
    install()
    import train_full_sft

    return train_full_sft.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
