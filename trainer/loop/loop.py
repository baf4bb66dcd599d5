"""Step 6 (and the saves of step 7): the optimizer-step loop.

One optimizer step = `accumulation_steps` micro-batches on every rank. Its loss is the mean
over ALL loss tokens of all those micro-batches on all ranks: the ranks first agree on that
token count (one small all-reduce, which also carries the "stop now" flag for preemption), each
micro-batch contributes `sum of its token losses / global count`, and DDP's gradient averaging
(FSDP2's reduce-scatter averages the same way) is undone by a factor of world_size. So N ranks x
B samples is the same step as 1 rank x N*B, and accumulation is the same as a bigger batch. Gradients are all-reduced once per optimizer
step (`run.parallel.micro_step`: no_sync, or no reduce-scatter, on the other micro-steps).

Host synchronisation: none per micro-step; per optimizer step one on one process (whether the
gradient norm is finite, read together with the previous update's finite-weights check, see
`read_step_flags`) and one more with several processes (the token count / stop flag); one per log
interval (the loss; with several training sources a second one for the per-source losses,
`trainer/loop/source_losses.py`).
The run and its resume state are trainer/loop/state.py.
"""

import itertools
import math
import os
import time
from typing import NamedTuple

import torch

from dataset import IGNORE_INDEX, model_inputs
from trainer.checkpoint.save_dir import BEST_DIR, BEST_FILE
from trainer.errors import CheckpointError, TrainingError
from trainer.evaluation.evaluate import evaluate
from trainer.evaluation.selection import best_record, update_selection
from trainer.loop.lr_schedule import cosine_lr, default_warmup_steps, set_lr
from trainer.loop.source_losses import SourceLosses
from trainer.loop.state import Run, WeightsCheck, resume_state
from trainer.runtime.distributed import all_reduce_sum, broadcast_object
from trainer.runtime.precision import autocast
from trainer.loop.saves import finish_saves, raise_on_every_rank, save_in_background
from trainer.weights.write import publish_inference_weights

# Fault injection for tests/e2e/test_fault_tolerance.py, read in `injected_nan_steps` and nowhere else:
# a comma-separated list of optimizer steps (numbered from 1, as in the logs) whose loss is made
# NaN, e.g. MINISFT_FAULT_NAN_STEPS="3,4,5". Leave it unset for real training.
FAULT_NAN_STEPS_ENV = "MINISFT_FAULT_NAN_STEPS"
# A planted bug for tests/scripts/test_verify_equivalence.py, read in `agree_on_step` and nowhere else:
# MINISFT_FAULT_LOCAL_MEAN=1 makes every rank divide its token loss by its OWN loss-token count instead of
# the step's global count, so DDP averages per-rank means (the classic normalisation bug) and N ranks x B
# no longer equal 1 rank x N*B; scripts/verify_equivalence.py must report it. Leave it unset for real training.
FAULT_LOCAL_MEAN_ENV = "MINISFT_FAULT_LOCAL_MEAN"


def save(run: Run) -> None:
    """The resume checkpoint and the inference weights, written in the background
    (trainer/loop/saves.py); a failed write stops every rank at the next save or at the end."""
    settle_weights_check(run)  # never a non-finite weight in a file
    save_in_background(run)


# --------------------------------------------------------------------------- steps


def steps_in_epoch(run: Run, epoch: int, start: int) -> int:
    sampler = run.data.sampler
    sampler.set_epoch(epoch)
    sampler.set_start_index(start)
    micro_batches = math.ceil(len(sampler) / run.args.batch_size)
    return math.ceil(micro_batches / run.args.accumulation_steps)


def count_total_steps(run: Run) -> int:
    state, args = run.state, run.args
    natural = state.step + sum(
        steps_in_epoch(run, epoch, state.samples_in_epoch if epoch == state.epoch else 0)
        for epoch in range(state.epoch, args.epochs)
    )
    return min(natural, args.max_steps) if args.max_steps else natural


class StepTotals(NamedTuple):
    """What the ranks agree on before an optimizer step (one all-reduce)."""

    loss_tokens: int  # tokens with a label, all micro-batches of all ranks: the token loss divides by it
    real_tokens: int  # non-pad tokens (for tokens/s)
    sequences: int  # rows with a real token: the MoE balance loss divides by it
    stop: bool  # some rank must stop now (preemption)


def agree_on_step(run: Run, micro_batches: list[dict]) -> StepTotals:
    """Global loss-token, real-token and row counts, and whether any rank must stop now."""
    loss_tokens = sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches)
    real_tokens = sum(int(mb["attention_mask"].sum()) for mb in micro_batches)
    sequences = sum(int(mb["attention_mask"].any(dim=1).sum()) for mb in micro_batches)
    stop = int(run.preemption.requested)
    local_loss_tokens = loss_tokens
    if run.ctx.distributed:
        figures = torch.tensor([loss_tokens, real_tokens, sequences, stop], dtype=torch.int64, device=run.ctx.device)
        loss_tokens, real_tokens, sequences, stop = all_reduce_sum(figures).tolist()
    if os.environ.get(FAULT_LOCAL_MEAN_ENV) == "1":  # planted bug (test-only): x world_size then gives sum / local count
        loss_tokens = local_loss_tokens * run.ctx.world_size
    return StepTotals(loss_tokens, real_tokens, sequences, bool(stop))


def injected_nan_steps() -> frozenset[int]:
    text = os.environ.get(FAULT_NAN_STEPS_ENV, "")
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise TrainingError(f"{FAULT_NAN_STEPS_ENV}={text!r}: expected step numbers like 3,4,5") from error


def optimizer_step(run: Run, micro_batches: list[dict], totals: StepTotals, lr: float, inject_nan: bool = False,
                   source_losses: SourceLosses | None = None):
    """Forward/backward over the micro-batches, clip, step. Returns (loss contribution, grad norm, applied).

    Every micro-batch's token loss is divided by the step's global loss-token count and its MoE
    balance loss by the step's global row count, so the step's objective does not depend on how
    the rows are split over ranks and micro-batches. An applied update leaves its finite-weights
    check in `run.weights_check` (read by the next step's one host sync, or by the next save/eval).
    `inject_nan` (fault injection, see FAULT_NAN_STEPS_ENV) makes this step's loss NaN.
    `source_losses` (several training sources) gets every micro-batch's per-token losses."""
    model, ctx, scaler = run.model, run.ctx, run.scaler
    set_lr(run.optimizer, lr)
    local_loss = torch.zeros((), device=ctx.device)
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with run.parallel.micro_step(model, last):
            with autocast(ctx.device, run.dtype):
                out = model(**model_inputs(batch, ctx.device), num_items_in_batch=max(totals.loss_tokens, 1),
                            num_sequences_in_batch=max(totals.sequences, 1), skip_logits=True,
                            **({"return_token_losses": True} if source_losses else {}))
            loss = out.loss * float("nan") if inject_nan else out.loss
            if source_losses:
                source_losses.add_micro_batch(out.token_losses, batch)
            # x world_size undoes DDP's averaging: the gradient is the mean over all loss tokens (rows).
            objective = (loss + out.aux_loss) * ctx.world_size
            scaler.scale(objective).backward()
        local_loss += loss.detach().float()
    scaler.unscale_(run.optimizer)
    max_norm = run.args.grad_clip if run.args.grad_clip > 0 else float("inf")
    grad_norm = run.parallel.clip_grad_norm(max_norm)
    finite = read_step_flags(run, grad_norm)
    if scaler.is_enabled():
        scaler.step(run.optimizer)  # skips the update itself when it found inf/NaN
        scaler.update()
    elif finite:
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    if finite:
        run.weights_check = WeightsCheck(run.state.step + 1, non_finite_weights(run))  # this step's number
    return local_loss, grad_norm.detach(), finite


def read_step_flags(run: Run, grad_norm: torch.Tensor) -> bool:
    """The optimizer step's one host sync: whether the gradient norm is finite and, in the same
    transfer, the previous update's finite-weights check (raises TrainingError if that update
    broke the weights, before this step can update them again)."""
    check, run.weights_check = run.weights_check, None
    bad = check.bad if check is not None else torch.zeros((), device=grad_norm.device)
    finite, weights_bad = torch.stack([torch.isfinite(grad_norm).float(), bad.float()]).tolist()
    if weights_bad:
        raise_non_finite_weights(run, check.step)
    return bool(finite)


def track_bad_steps(run: Run, finite: bool) -> None:
    """Count non-finite steps; too many in a row stops the run with the last good weights saved."""
    state = run.state
    if finite:
        state.bad_steps_in_a_row = 0
        return
    state.skipped_steps += 1
    # With float16 the GradScaler skips overflowing steps while it calibrates its scale; only
    # count those once the scale is tiny (the loss itself is non-finite, not just large).
    if run.scaler.is_enabled() and run.scaler.get_scale() >= 1.0:
        return
    state.bad_steps_in_a_row += 1
    run.logger.print(
        f"warning: step {state.step} had a non-finite loss or gradient norm: optimizer step skipped "
        f"({state.bad_steps_in_a_row} in a row, {state.skipped_steps} in total)"
    )
    if state.bad_steps_in_a_row >= run.args.max_bad_steps:
        save(run)
        finish_saves(run)
        raise TrainingError(
            f"{state.bad_steps_in_a_row} optimizer steps in a row had a non-finite loss or gradient norm "
            f"(last at step {state.step}); stopped. The last good weights are saved in {run.args.save_dir}"
        )


@torch.no_grad()
def non_finite_weights(run: Run) -> torch.Tensor:
    """After an applied update, on the device (no host sync): 1.0 if some weight is inf/NaN, else 0.0.
    A finite gradient norm alone does not prove the weights finite: a huge learning rate turns
    finite gradients into inf/NaN weights.

    The smallest and the largest value of each parameter (one `aminmax` pass): a NaN anywhere makes
    them NaN, an inf makes one of them inf, finite values keep them finite, so they are all finite
    exactly when every weight is. It replaced the inf-norm of each parameter, which cost about
    three times as much on CPU (`scripts/bench.py --step_compare` times both)."""
    params = list(run.raw_model.parameters())
    sharded = any(hasattr(p, "to_local") for p in params)  # --fsdp 1: each rank checks its shards
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    extremes = [value for p in local if p.numel() for value in torch.aminmax(p)]  # a rank's shard may be empty
    device = local[0].device if local else run.ctx.device
    bad = (~torch.isfinite(torch.stack(extremes))).any().float() if extremes else torch.zeros((), device=device)
    if sharded:
        all_reduce_sum(bad)  # every rank takes the same decision
    return bad


def settle_weights_check(run: Run) -> None:
    """Read the last update's finite-weights check now (before a save or an evaluation): the run
    stops before a non-finite weight can reach any file."""
    check, run.weights_check = run.weights_check, None
    if check is not None and bool(check.bad):
        raise_non_finite_weights(run, check.step)


def raise_non_finite_weights(run: Run, step: int):
    """The checkpoints already on disk stay the last good ones."""
    raise TrainingError(
        f"step {step} made the weights non-finite (--learning_rate {run.args.learning_rate:g} or --weight_decay {run.args.weight_decay:g} too large?); "
        f"stopped without saving them. The checkpoints in {run.args.save_dir} are the last good weights"
    )


def save_best(run: Run) -> None:
    """Rank 0 writes `<save_dir>/best/` (inference weights + best.json); a failed write stops every rank."""
    state, args = run.state, run.args
    error = None
    weights = run.parallel.inference_model(getattr(torch, args.save_dtype))  # collective under --fsdp 1
    if run.ctx.is_main:
        try:
            record = best_record(args.keep_best, state.best_value, state.best_step)
            publish_inference_weights(weights, run.tokenizer, args.save_dir, getattr(torch, args.save_dtype),
                                              name=BEST_DIR, extra_files={BEST_FILE: record})
        except CheckpointError as failure:
            error = str(failure)
    del weights
    raise_on_every_rank(error)


def evaluate_and_select(run: Run) -> bool:
    """Evaluate, log, keep the best model; True when early stopping says the run should end."""
    state, args = run.state, run.args
    settle_weights_check(run)
    # Rank 0's figures everywhere: every rank then takes the same keep/stop decision, bit for bit.
    figures = broadcast_object(evaluate(run))
    new_best = stop = False
    if args.keep_best:
        new_best, stop = update_selection(state, args.keep_best, figures, args.early_stop_patience)
        if new_best:
            save_best(run)
    run.logger.log_eval(state.step, figures, args.keep_best, state.best_value, state.best_step, new_best)
    if stop:
        run.logger.log_early_stop(state.step, args.keep_best, state.evals_without_improvement,
                                  state.best_value, state.best_step)
    return stop


# --------------------------------------------------------------------------- the loop


def train(run: Run) -> str:
    """Train until the last step, `--max_steps`, preemption or an early stop (`--early_stop_patience`).
    Returns "finished", "preempted" or "early_stopped"."""
    args, state, logger = run.args, run.state, run.logger
    logger.run_id = state.run_id
    total_steps = count_total_steps(run)
    warmup = args.warmup_steps if args.warmup_steps is not None else default_warmup_steps(total_steps)
    run.model.train()
    logger.print(
        f"training {total_steps} optimizer steps from step {state.step}: {run.ctx.world_size} process(es) x "
        f"batch {args.batch_size} x accumulation {args.accumulation_steps}, dtype {str(run.dtype).split('.')[-1]}, "
        f"device {run.ctx.device}"
    )
    interval = {"loss": torch.zeros((), device=run.ctx.device), "steps": 0, "tokens": 0, "start": time.time(),
                "run_start": time.time(), "run_first_step": state.step,
                # a resume off the log grid: the first window averages only the steps since then
                "resumed_at": state.step if state.step % args.log_interval else None,
                # several training sources: their losses per log window
                "sources": SourceLosses(run.data.source_names, run.ctx.device) if len(run.data.source_names) > 1 else None}
    nan_steps = injected_nan_steps()
    last_saved = last_eval = state.step
    status = "finished"
    while state.step < total_steps and state.epoch < args.epochs:
        sampler = run.data.sampler
        sampler.set_epoch(state.epoch)
        sampler.set_start_index(state.samples_in_epoch)
        run.data.dataset.set_epoch(state.epoch)  # the epoch the augmentations are drawn for
        batches = iter(run.data.loader)
        while state.step < total_steps:
            micro_batches = list(itertools.islice(batches, args.accumulation_steps))
            if not micro_batches:  # defensive: the sampler always covers the epoch
                state.epoch, state.samples_in_epoch = state.epoch + 1, 0
                break
            totals = agree_on_step(run, micro_batches)
            if totals.stop:
                status = "preempted"
                break
            lr = cosine_lr(state.step, total_steps, args.learning_rate, warmup, args.min_lr_ratio)
            loss, grad_norm, finite = optimizer_step(run, micro_batches, totals, lr,
                                                     inject_nan=state.step + 1 in nan_steps,
                                                     source_losses=interval["sources"])
            if interval["sources"]:
                interval["sources"].end_step(totals.loss_tokens, finite)
            state.step += 1
            consumed = sum(len(mb["input_ids"]) for mb in micro_batches) * run.ctx.world_size
            state.samples_in_epoch += consumed
            if state.samples_in_epoch >= len(run.data.dataset):
                state.epoch, state.samples_in_epoch = state.epoch + 1, 0
            track_bad_steps(run, finite)
            if finite:
                interval["loss"] += loss
                interval["steps"] += 1
            interval["tokens"] += totals.real_tokens
            if state.step % args.log_interval == 0 or state.step == total_steps:
                log_interval(run, interval, grad_norm, lr, total_steps)
            if run.eval_sets and args.eval_interval and state.step % args.eval_interval == 0:
                last_eval = state.step
                if evaluate_and_select(run):
                    status = "early_stopped"
                    break
            if args.save_interval and state.step % args.save_interval == 0:
                save(run)
                last_saved = state.step
            if state.samples_in_epoch == 0:
                break  # epoch finished: the outer loop starts the next one
        if status != "finished":
            break
    if status == "preempted":
        logger.print(f"{run.preemption.reason or 'a stop signal (on another rank)'} received: stopping at step {state.step} and saving a resume checkpoint")
    elif run.eval_sets and last_eval != state.step:
        evaluate_and_select(run)
    if last_saved != state.step or status == "preempted" or state.step == 0:
        save(run)
    finish_saves(run)
    return status


def log_interval(run: Run, interval: dict, grad_norm: torch.Tensor, lr: float, total_steps: int) -> None:
    """Reduce the interval's loss over ranks (the one host sync per log interval) and report it."""
    state = run.state
    loss_sum = all_reduce_sum(interval["loss"].clone()).item()
    elapsed = max(time.time() - interval["start"], 1e-9)
    steps_this_run = max(state.step - interval["run_first_step"], 1)
    seconds_per_step = (time.time() - interval["run_start"]) / steps_this_run  # ETA from the run's average
    norm = float(grad_norm)
    figures = {  # None (JSON null) rather than NaN: every step was skipped / the last norm was not finite
        "loss": loss_sum / interval["steps"] if interval["steps"] else None,
        "lr": lr,
        "grad_norm": norm if math.isfinite(norm) else None,
        "tokens_per_s": interval["tokens"] / elapsed,
        "skipped_steps": state.skipped_steps,
        **(interval["sources"].figures() if interval["sources"] else {}),  # loss/<source>, loss_tokens/<source>, ...
    }
    if interval["resumed_at"] is not None:  # a shorter window than --log_interval: said on the line and the row
        figures.update(resumed_at_step=interval["resumed_at"], loss_steps=interval["steps"])
        interval["resumed_at"] = None
    shown_epoch = min(state.epoch, run.args.epochs - 1)  # the step that ends the last epoch belongs to it
    run.logger.log_train(state.step, total_steps, shown_epoch, run.args.epochs, figures,
                         eta_s=seconds_per_step * (total_steps - state.step))
    interval.update(loss=torch.zeros((), device=run.ctx.device), steps=0, tokens=0, start=time.time())
