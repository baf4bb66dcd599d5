"""Full-parameter SFT of a MiniMind model, in the order of the reference walkthrough:

    1. init distributed        (torchrun / SLURM / legacy launch / --world_size N / plain python)
    2. seed                    (base seed + rank)
    3. config + lm_checkpoint  (--from_weight and its tokenizer; model config from the weights or the
                                flags; find and check the resume checkpoint)
    4. data                    (SFT dataset, tokenized once; resumable DistributedSampler)
    5. model                   (from scratch or --from_weight; DDP ignoring the RoPE buffers, or FSDP2)
    6. training loop           (autocast + GradScaler, gradient accumulation with no_sync)
    7. saves                   (resume checkpoint + inference weights, atomic; --fsdp 1: DCP shards)
    8. logging on rank 0       (progress, metrics.jsonl, wandb)
    9. clean shutdown

Examples:
    python train_full_sft.py                                   # 1 process: cuda:0 or CPU
    torchrun --nproc_per_node 2 train_full_sft.py              # 2 processes on this node
    python train_full_sft.py --from_resume 1                   # continue the latest checkpoint
See README.md for multi-node, SLURM and elastic launches.
"""

import gc
import os
import sys

from trainer.runtime.preemption import PreemptionFlag, keep_exit_code

# Run as a script, SIGTERM and Ctrl-C are handled from here on, before the slow imports below:
# a scheduler's SIGTERM during start-up also ends in a clean stop (exit 0), not in exit 143; and
# one while the process finalizes leaves its exit code as it is.
EARLY_PREEMPTION = None
if __name__ == "__main__":
    EARLY_PREEMPTION = PreemptionFlag().install()
    keep_exit_code()

import torch

from dataset.mixture import absolute_data_path
from dataset.printable import print_escaped, printable
from trainer.args import parse_args
from trainer.checkpoint.resume import (
    check_model_config, claim_for_resume, find_resume_checkpoint, load_resume_checkpoint,
)
from trainer.checkpoint.save_dir import (
    BEST_DIR, MODEL_DIR, Claim, SaveDirLock, check_folder_can_be_made, claim_for_fresh_run, ensure_writable_dir,
    inside_a_run_model_dir,
)
from trainer.checkpoint.shared_dir import check_every_rank_sees, read_on_every_rank, why_every_rank_uses
from trainer.data_setup import build_eval_sets, build_train_data, check_data_files
from trainer.errors import (
    USER_ERRORS, BuildInterrupted, CheckpointError, NodeLaunchError, TrainingError, names_a_user_path,
)
from trainer.evaluation.evaluate import metric_names
from trainer.evaluation.selection import check_selection, flag_problems as selection_flag_problems
from trainer.loop.loop import check_something_to_train, train
from trainer.loop.state import Run, restore, take_save_dir
from trainer.model_setup import (
    build_model, build_model_config, build_optimizer, compile_model, load_tokenizer_for_weights, log_start_weights,
    read_initial_weights,
)
from trainer.parallel import build_parallelism
from trainer.run_logger import RunLogger, check_wandb_login
from trainer.runtime.distributed import (
    broadcast_object, cleanup, init_distributed, is_peer_failure, peer_failure_message, print_once,
    spawn_local_workers, spawned_by_us,
)
from trainer.runtime.kernels import prefer_flash_attention
from trainer.runtime.node_lines import TORCHRUN_NAMES, launcher_names, print_for_node
from trainer.runtime.precision import apply_tf32_policy, build_grad_scaler, resolve_dtype
from trainer.runtime.seeding import setup_seed
from trainer.weights.read import minimind_pth_name


def claim_save_dir(args, ctx):
    """Rank 0 checks that --save_dir (and --cache_dir) can be written, before a fresh run with
    --overwrite 1 sets a previous run aside, and locks --save_dir for this run (another process
    writing there would mix or prune its checkpoints). Where the other ranks use --save_dir too,
    every rank then checks that it sees that directory (trainer/checkpoint/shared_dir.py). Returns
    the lock (None on other ranks)."""
    lock = None
    if ctx.is_main:
        run_model = inside_a_run_model_dir(args.save_dir)
        if run_model:
            raise CheckpointError(f"--save_dir {args.save_dir} is inside {run_model}, a run's weights folder that "
                                  "its next save replaces: choose a directory outside it")
        ensure_writable_dir(args.save_dir)
        if args.cache_dir:
            check_folder_can_be_made(args.cache_dir, "--cache_dir")
        check_wandb_login(args)
        lock = SaveDirLock(args.save_dir).acquire()
    check_every_rank_sees(args.save_dir, why_every_rank_uses(args), ctx)
    return lock


def locate_resume(args, config, ctx, log) -> tuple[dict | None, Claim]:
    """Step 3: the resume checkpoint to continue from (the same one on every rank), or None, and how the
    run takes --save_dir (the same `Claim` on every rank).

    Rank 0 chooses it (and refuses a fresh run into another run's --save_dir unless --overwrite 1);
    every process then reads the file once, memory-mapped, and the ranks check that they read the same
    checkpoint (trainer/checkpoint/shared_dir.py)."""
    path, saved, claim, problem = None, None, None, None
    if ctx.is_main:
        try:
            path, saved, claim = choose_resume_checkpoint(args, config, log)
        except CheckpointError as error:
            problem = str(error)
    path, claim, problem = broadcast_object((path, claim, problem))
    if problem:
        raise CheckpointError(problem)
    if path is None:
        return None, claim
    saved = read_on_every_rank(path, saved, ctx)
    check_model_config(saved["model_config"], config)
    log(f"resuming from {path} (step {saved['step']}, epoch {saved['epoch'] + 1}, sample {saved['samples_in_epoch']})")
    return saved, claim


def choose_resume_checkpoint(args, config, log) -> tuple[str | None, dict | None, Claim]:
    """On rank 0: (path, loaded checkpoint) to resume from, or (None, None) for a fresh run, and the
    `Claim` on --save_dir: a --save_dir of another run is refused, or with --overwrite 1 its files (its
    MiniMind .pth too) are to be set aside once every check has passed."""
    pth_name = minimind_pth_name(args.save_weight, config.hidden_size, config.use_moe) if args.save_weight else None
    if args.resume_from:
        saved = load_resume_checkpoint(args.resume_from)
        return args.resume_from, saved, claim_for_resume(args.save_dir, args.resume_from, saved, args.overwrite,
                                                         pth_name)
    found = find_resume_checkpoint(args.save_dir, log=log) if args.from_resume else None
    if found:
        return *found, Claim(args.save_dir)
    claim = claim_for_fresh_run(args.save_dir, args.overwrite, resuming=bool(args.from_resume), pth_name=pth_name)
    if args.from_resume:
        log(f"--from_resume 1: no resume checkpoint in {args.save_dir}, starting from scratch")
    return None, None, claim


def run_training(args, preemption: PreemptionFlag) -> int:
    # 1. Init distributed: process group (if launched with several processes) and device.
    ctx = init_distributed(args)
    # 2. Seed: per-rank randomness; the data order has its own seed, shared by all ranks.
    setup_seed(args.seed + ctx.rank)
    save_dir_lock = claim_save_dir(args, ctx)

    # 3. Initial weights (--from_weight) and their tokenizer; the config from the weights, else
    # from the flags; the resume checkpoint (lm_checkpoint) if asked for.
    log = print_escaped if ctx.is_main else (lambda message: None)
    warn_flags_without_effect(args, ctx, log)
    dtype = resolve_dtype(args.dtype, ctx.device, log)  # --dtype float16 on a CPU: refused before any data is read
    sources = check_data_files(args, log)  # a missing source or held-out file: refused before a run is set aside
    weights = read_initial_weights(args, log)
    tokenizer, tokenizer_path = load_tokenizer_for_weights(args, weights, log)
    config = build_model_config(args, tokenizer, weights, ctx.device)
    saved, claim = locate_resume(args, config, ctx, log)
    if args.resume_from or args.from_resume:
        log_start_weights(args, weights, saved, log)

    # 4. Data: tokenized once into a memory-mapped cache; a sampler that can start mid-epoch; the
    # run's identity (what defines its sample stream), from the data opened, kept in every checkpoint.
    data = build_train_data(args, tokenizer, ctx, sources)
    eval_sets = build_eval_sets(args, tokenizer, ctx, config.max_position_embeddings)
    check_selection(args, metric_names(eval_sets))

    # 5. Model, its DDP (or --fsdp 1: FSDP2) wrapper, optimizer and mixed precision, resume state.
    model = build_model(args, config, ctx.device, weights if saved is None else None, resumed=saved is not None)
    del weights
    apply_tf32_policy(dtype, args.tf32)
    prefer_flash_attention()
    parallel = build_parallelism(args, ctx, dtype)
    wrapped = parallel.wrap(model)  # DDP around the model, or the model itself sharded in place
    optimizer = build_optimizer(model, args, ctx.device)
    # The logger is finished (wandb.finish) however the run ends, also before fail()'s os._exit. A fork
    # logs to a wandb run of its own.
    wandb_run_id = saved.get("wandb_run_id") if saved and not claim.forked_from else None
    with RunLogger(args, ctx.is_main, wandb_run_id, claim.forked_from) as logger:
        run = Run(args, ctx, wrapped, optimizer, build_grad_scaler(ctx.device, dtype), dtype, data, eval_sets,
                  tokenizer, logger, preemption, parallel, tokenizer_path)
        del wrapped  # run.model stays its only reference (see step 9)
        resumed = saved is not None
        if resumed:
            restore(run, saved, claim)  # moves nothing in --save_dir
        del saved
        check_something_to_train(run)
        take_save_dir(run, claim, resumed)  # every refusal (data, flags, model, checkpoint) is behind
        if args.use_compile:
            run.model = compile_model(run.model, ctx.device)

        # 6-8. The loop: autocast, accumulation, clipping, cosine LR; saves and logs on rank 0.
        try:
            status = train(run)
        finally:
            run.writer.join()  # a run stopped by an error still completes the checkpoint being written

        # 9. Clean shutdown. The model goes first, while its process group is still alive: its DDP
        # wrapper, or its FSDP-sharded parameters and their optimizer state, freed after
        # destroy_process_group can deadlock gloo's worker thread or abort the process.
        del run
    del model, optimizer, parallel
    gc.collect()
    cleanup(ctx)
    if save_dir_lock:
        save_dir_lock.release()
    if status == "preempted":
        log(f"stopped after {preemption.reason or 'a stop signal on another rank'}; continue with --from_resume 1")
    else:
        if status == "early_stopped":
            log(f"stopped early: no improvement of {args.keep_best} in {args.early_stop_patience} evaluations")
        log(done_line(args.save_dir))
    return 0


def done_line(save_dir: str) -> str:
    """The run's last line: the weights folders that --save_dir holds at its end (a resume with nothing
    left to train writes none, so what is not there is not named) and how to talk to the model."""
    model, best = (os.path.join(save_dir, name) for name in (MODEL_DIR, BEST_DIR))
    if not os.path.isdir(model):
        return f"done: {save_dir} holds no {MODEL_DIR}/ (nothing was trained in this run)"
    kept = f" (the best evaluation's in {best})" if os.path.isdir(best) else ""
    return f"done: the model is in {model}{kept}; talk to it with: python scripts/chat.py --model_path {save_dir}"


def warn_flags_without_effect(args, ctx, log) -> None:
    """Flags that mean nothing in this run, given to it: said, not ignored silently. Those that only
    mean something with several processes, on a GPU, or with wandb; --local_rank without a launcher."""
    if args.tf32 == "1" and ctx.device.type != "cuda":
        log(f"warning: --tf32 1 on {ctx.device.type}: TF32 is a mode of CUDA tensor cores, so it is not used")
    for name in ("wandb_project", "wandb_run_name"):
        if name in args.explicit_flags and not args.use_wandb:
            log(f"warning: --{name} {getattr(args, name)} without --use_wandb 1: nothing is logged to wandb, "
                "so it is not used")
    if args.local_rank is not None and launcher_names(os.environ) != TORCHRUN_NAMES:  # local_rank_from reads it
        log(f"warning: --local_rank {args.local_rank} without a launcher: it is set by `python -m "
            "torch.distributed.launch`; this process is the only one, so it is not used")
    if ctx.world_size > 1:
        return
    if args.fsdp:
        log("warning: --fsdp 1 in one process: there is nothing to shard over, the model trains unsharded "
            "(start several processes with torchrun or --world_size N to shard it)")
    if args.backend != "auto":
        log(f"warning: --backend {args.backend} in one process: no process group is created, so it is not used")


def main(argv=None) -> int:
    # First of all: SIGTERM / Ctrl-C from now until the process ends stop the run cleanly (exit 0).
    preemption = EARLY_PREEMPTION or PreemptionFlag().install()
    args = parse_args(argv, checks=(selection_flag_problems,))  # before the data is read: fails in a second
    args.data_path = absolute_data_path(args.data_path)  # every source's path, weights kept
    if args.world_size > 1 and spawned_by_us():
        return spawn_local_workers(main, argv if argv is not None else sys.argv[1:], args.world_size)
    try:
        return run_training(args, preemption)
    except BuildInterrupted as interrupt:
        return fail(f"stopped: {interrupt}", 128 + interrupt.signum)
    except NodeLaunchError as error:  # before the process group, alike on the node's every process
        print_for_node(printable(f"error: {error}", one_line=True))
        return 2
    except USER_ERRORS as error:
        return fail(f"error: {error}", 2, every_rank=True)
    except TrainingError as error:
        return fail(f"error: {error}", 1, every_rank=error.every_rank)
    except OSError as error:
        if not names_a_user_path(error, args):
            raise
        return fail(f"error: {error.filename}: {error.strerror or error}", 2)
    except RuntimeError as error:
        if not is_peer_failure(error):
            raise
        return fail(f"error: {peer_failure_message(error)}", 1)


def fail(message: str, code: int, every_rank: bool = False) -> int:
    """Print one line and return the exit code. With a live process group, leave at once
    instead: freeing a DDP model after a failure can deadlock gloo's teardown, and the peers
    are failing (or already gone) anyway. ``every_rank``: a line that other ranks may fail with
    too (bad data, a missing file): printed once where they agree (`print_once`). The line is
    escaped, newlines too: it may name a file whose name holds control characters."""
    message = printable(message, one_line=True)
    if every_rank:
        print_once(message)
    else:
        print(message, file=sys.stderr, flush=True)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        sys.stdout.flush()
        os._exit(code)
    return code

if __name__ == "__main__":
    sys.exit(main())
