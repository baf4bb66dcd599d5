"""Full-parameter SFT of a MiniMind model, in the order of the reference walkthrough:

    1. init distributed        (torchrun / SLURM / legacy launch / --world_size N / plain python)
    2. seed                    (base seed + rank)
    3. config + lm_checkpoint  (model config from flags; find and check the resume checkpoint)
    4. data                    (SFT dataset, tokenized once; resumable DistributedSampler)
    5. model                   (from scratch or --from_weight; DDP ignoring the RoPE buffers)
    6. training loop           (autocast + GradScaler, gradient accumulation with no_sync)
    7. saves on rank 0         (resume checkpoint + inference weights, atomic)
    8. logging on rank 0       (progress, metrics.jsonl, wandb)
    9. clean shutdown

Examples:
    python train_full_sft.py                                   # 1 process: cuda:0 or CPU
    torchrun --nproc_per_node 2 train_full_sft.py              # 2 processes on this node
    python train_full_sft.py --from_resume 1                   # continue the latest checkpoint
See README.md for multi-node, SLURM and elastic launches.
"""

import os
import sys

import torch

from dataset import DataError, load_tokenizer
from trainer.args import parse_args
from trainer.checkpoint import CheckpointError, check_model_config, ensure_writable_dir, find_resume_checkpoint
from trainer.checkpoint import load_resume_checkpoint
from trainer.data_setup import build_eval_loader, build_train_data
from trainer.distributed import (
    DistributedError, broadcast_object, cleanup, init_distributed, is_peer_failure, peer_failure_message,
    spawn_local_workers, spawned_by_us,
)
from trainer.loop import Run, TrainingError, restore, train
from trainer.model_setup import (
    ConfigError, build_grad_scaler, build_model, build_model_config, build_optimizer, resolve_dtype,
    wrap_for_distributed,
)
from trainer.preemption import PreemptionFlag
from trainer.run_logger import LoggingError, RunLogger, check_wandb_login
from trainer.seeding import setup_seed

# Problems the user can fix (data, paths, flags, checkpoints, the launch, a full disk named by
# path): reported as one line, exit code 2. Anything else is a bug and keeps its traceback.
USER_ERRORS = (DataError, CheckpointError, ConfigError, DistributedError, LoggingError)


def locate_resume(args, config, ctx, log) -> dict | None:
    """Step 3: the resume checkpoint to continue from (the same one on every rank), or None."""
    path = None
    if args.resume_from:
        path = args.resume_from
    elif args.from_resume and ctx.is_main:
        found = find_resume_checkpoint(args.save_dir, log=log)
        path = found[0] if found else None
        if path is None:
            log(f"--from_resume 1: no resume checkpoint in {args.save_dir}, starting from scratch")
    if args.from_resume:
        path = broadcast_object(path)
    if path is None:
        return None
    saved = load_resume_checkpoint(path)
    check_model_config(saved["model_config"], config)
    log(f"resuming from {path} (step {saved['step']}, epoch {saved['epoch'] + 1}, sample {saved['samples_in_epoch']})")
    return saved


def run_training(args, preemption: PreemptionFlag) -> int:
    # 1. Init distributed: process group (if launched with several processes) and device.
    ctx = init_distributed(args)
    # 2. Seed: per-rank randomness; the data order has its own seed, shared by all ranks.
    setup_seed(args.seed + ctx.rank)
    if ctx.is_main:
        ensure_writable_dir(args.save_dir)
        check_wandb_login(args)

    # 3. Config from the flags, and the resume checkpoint (lm_checkpoint) if asked for.
    tokenizer = load_tokenizer(args.tokenizer_path)
    config = build_model_config(args, tokenizer)
    log = print if ctx.is_main else (lambda message: None)
    saved = locate_resume(args, config, ctx, log)

    # 4. Data: tokenized once into a memory-mapped cache; a sampler that can start mid-epoch.
    data = build_train_data(args, tokenizer, ctx)
    eval_loader = build_eval_loader(args, tokenizer, ctx)

    # 5. Model (+ optimizer and mixed precision), resume state, then the DDP wrapper.
    model = build_model(args, config, ctx.device)
    optimizer = build_optimizer(model, args, ctx.device)
    dtype = resolve_dtype(args.dtype, ctx.device, log)
    # The logger is finished (wandb.finish) however the run ends, also before fail()'s os._exit.
    with RunLogger(args, ctx.is_main, wandb_run_id=saved.get("wandb_run_id") if saved else None) as logger:
        run = Run(args, ctx, model, optimizer, build_grad_scaler(ctx.device, dtype), dtype, data, eval_loader,
                  tokenizer, logger, preemption)
        if saved is not None:
            restore(run, saved)
            del saved
        run.model = wrap_for_distributed(model, ctx)
        if args.use_compile:
            run.model = torch.compile(run.model)

        # 6-8. The loop: autocast, accumulation, clipping, cosine LR; saves and logs on rank 0.
        status = train(run)

        # 9. Clean shutdown. The DDP wrapper goes first, while its process group is still alive:
        # freeing it after destroy_process_group can deadlock gloo's worker thread on the GIL.
        run.model = None
    cleanup(ctx)
    if status == "preempted":
        log(f"stopped after {preemption.reason or 'a stop signal on another rank'}; continue with --from_resume 1")
    return 0


def main(argv=None) -> int:
    # First of all: SIGTERM / Ctrl-C from now until the process ends stop the run cleanly (exit 0).
    preemption = PreemptionFlag().install()
    args = parse_args(argv)
    if args.world_size > 1 and spawned_by_us():
        return spawn_local_workers(main, argv if argv is not None else sys.argv[1:], args.world_size)
    try:
        return run_training(args, preemption)
    except USER_ERRORS as error:
        return fail(f"error: {error}", 2)
    except TrainingError as error:
        return fail(f"error: {error}", 1)
    except RuntimeError as error:
        if not is_peer_failure(error):
            raise
        return fail(f"error: {peer_failure_message(error)}", 1)


def fail(message: str, code: int) -> int:
    """Print one line and return the exit code. With a live process group, leave at once
    instead: freeing a DDP model after a failure can deadlock gloo's teardown, and the peers
    are failing (or already gone) anyway."""
    print(message, file=sys.stderr, flush=True)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        sys.stdout.flush()
        os._exit(code)
    return code

if __name__ == "__main__":
    sys.exit(main())
