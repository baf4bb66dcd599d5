"""Step 6 (and the saves of step 7): the optimizer-step loop.

One optimizer step = `accumulation_steps` micro-batches on every rank. Its loss is the mean
over ALL loss tokens of all those micro-batches on all ranks: the ranks first agree on that
token count (one small all-reduce of host values, which also carries the "stop now" flag for
preemption and rank 0's "a save is due" of --save_every_minutes, trainer/loop/save_clock.py),
each micro-batch contributes `sum of its token losses / global count`, and DDP's gradient
averaging (FSDP2's reduce-scatter averages the same way) is undone by a factor of world_size.
So N ranks x B samples is the same step as 1 rank x N*B, and accumulation is the same as a
bigger batch. DDP all-reduces gradients once per optimizer step (`run.parallel.micro_step`:
no_sync on the other micro-steps); FSDP2 reduce-scatters them after every micro-batch, so they
accumulate sharded.

Host synchronisation: none in a step between log lines. The counts come from the CPU batches
and are summed over the ranks on a gloo group of host memory (`all_reduce_sum_on_host`); a
non-finite step is skipped on the device, --max_bad_steps counted there, and the flags are read
at log lines, saves and evaluations (trainer/loop/health.py); the log line reads the loss (with
several training sources, the per-source losses too, trainer/loop/source_losses.py).
The run and its resume state are trainer/loop/state.py.
"""

import itertools
import math
import time
from typing import NamedTuple

import torch

from dataset import IGNORE_INDEX, model_inputs
from trainer.checkpoint.save_dir import BEST_DIR, BEST_FILE
from trainer.errors import CheckpointError, ConfigError, TrainingError
from trainer.evaluation.evaluate import evaluate
from trainer.evaluation.selection import best_record, stopped_early, update_selection
from trainer.loop.health import bad_steps_error, device_streak, read_steps, record_step
from trainer.loop.lr_schedule import (
    cosine_lr, run_warmup, schedule_change, schedule_record, set_lr, warmup_afresh, warmup_too_long,
)
from trainer.loop.out_of_memory import one_line_if_out_of_memory, save_out_of_memory
from trainer.loop.save_clock import SaveClock
from trainer.loop.source_losses import SourceLosses
from trainer.loop.state import Run
from trainer.loop.step_count import micro_batches, run_steps
from trainer.loop.throughput import Throughput
from trainer.run_logger import format_count
from trainer.runtime.distributed import all_reduce_sum, all_reduce_sum_on_host, broadcast_object
from trainer.runtime.precision import autocast, restart_collapsed_scale, skip_also_where
from trainer.loop.saves import finish_saves, raise_on_every_rank, save_in_background
from trainer.weights.write import publish_inference_weights

def save(run: Run) -> None:
    """The resume checkpoint and the inference weights, written in the background
    (trainer/loop/saves.py); a failed write stops every rank at the next save or at the end."""
    settle(run)  # never a non-finite weight in a file; --max_bad_steps counted up to this step
    try:
        save_in_background(run)
    except torch.OutOfMemoryError as error:
        raise TrainingError(save_out_of_memory(run, error, "the save")) from None


# --------------------------------------------------------------------------- steps


def short_last_step(run: Run) -> str:
    """Where an epoch's micro-batches are no multiple of --accumulation_steps, its last optimizer step
    takes the rest, fewer rows, its loss the mean over its own tokens: said at the start, in words."""
    args, sampler = run.args, run.data.sampler
    rest = micro_batches(sampler.dataset_len, sampler.num_replicas, args.batch_size) % args.accumulation_steps
    return f"; each epoch's last step accumulates {rest} of {args.accumulation_steps} micro-batches" if rest else ""


def count_total_steps(run: Run) -> int:
    """The run's total of optimizer steps, from where it stands (trainer/loop/step_count.py)."""
    state, args, sampler = run.state, run.args, run.data.sampler
    return run_steps(sampler.dataset_len, sampler.num_replicas, args.batch_size, args.accumulation_steps,
                     args.epochs, args.max_steps, state.step, state.epoch, state.samples_in_epoch)


def nothing_left_to_train(run: Run, total_steps: int) -> str | None:
    """What to say where the run resumes at or past its last step `total_steps` or stopped early; else None."""
    state, args = run.state, run.args
    if not 0 < total_steps <= state.step:
        return stopped_early(state, args.keep_best, args.early_stop_patience)
    return (f"nothing left to train: the checkpoint is at step {state.step} and the run ends at step {total_steps} "
            f"(--epochs {args.epochs}, --max_steps {args.max_steps}); raise --epochs or --max_steps to train further")


def check_something_to_train(run: Run) -> None:
    """Refuse a resume with nothing left to train (`nothing_left_to_train`) before --save_dir changes
    (trainer/loop/state.py:take_save_dir): it would set the previous run or later checkpoints aside, or start a fork,
    and write nothing. Only --from_resume 1, a restarted job that has finished, goes on to say so and end: its directory
    stays as it is."""
    problem = nothing_left_to_train(run, count_total_steps(run))
    if problem and not run.args.from_resume:
        raise ConfigError(f"{problem}; nothing in {run.args.save_dir} was moved")


class StepTotals(NamedTuple):
    """What the ranks agree on before an optimizer step (one all-reduce)."""

    loss_tokens: int  # tokens with a label, all micro-batches of all ranks: the token loss divides by it
    real_tokens: int  # non-pad tokens (for tokens/s)
    sequences: int  # rows with a real token: the MoE balance loss divides by it
    stop: bool  # some rank must stop now (preemption)
    save: bool  # rank 0's clock says a save is due (--save_every_minutes): save at the end of this step
    flops: int  # model FLOPs of the step's micro-batches on all ranks (model/flops.py)


def agree_on_step(run: Run, micro_batches: list[dict], save_due: bool = False) -> StepTotals:
    """Global loss-token, real-token and row counts, whether any rank must stop now, whether this
    step ends with a save (`save_due`: rank 0's decision; the other ranks pass False), and the step's
    model FLOPs: counted on the CPU batches (before they move to the device) and summed over the
    ranks in host memory."""
    each_loss_tokens = [int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches]
    loss_tokens = sum(each_loss_tokens)
    real_tokens = sum(int(mb["attention_mask"].sum()) for mb in micro_batches)
    sequences = sum(int(mb["attention_mask"].any(dim=1).sum()) for mb in micro_batches)
    stop, save = int(run.preemption.requested), int(save_due)
    # the LM head's logits are computed at the loss positions only (model/loss.py)
    flops = sum(run.model_flops.of_batch(mb, n) for mb, n in zip(micro_batches, each_loss_tokens))
    if run.ctx.distributed:
        figures = torch.tensor([loss_tokens, real_tokens, sequences, stop, save, flops], dtype=torch.int64)
        loss_tokens, real_tokens, sequences, stop, save, flops = all_reduce_sum_on_host(figures).tolist()
    return StepTotals(loss_tokens, real_tokens, sequences, bool(stop), bool(save), flops)


class StepResult(NamedTuple):
    loss: torch.Tensor  # this rank's contribution to the step's loss (on the device)
    grad_norm: torch.Tensor
    finite: torch.Tensor  # whether the update was applied (bool, on the device)


def optimizer_step(run: Run, micro_batches: list[dict], totals: StepTotals, lr: float,
                   source_losses: SourceLosses | None = None) -> StepResult:
    """Forward/backward over the micro-batches, clip, step; nothing here waits for the device.

    Every micro-batch's token loss is divided by the step's global loss-token count and its MoE
    balance loss by the step's global row count, so the step's objective does not depend on how
    the rows are split over ranks and micro-batches. A non-finite gradient norm skips the update
    on the device (`found_inf` of fused AdamW; under float16 the GradScaler's own), as does a streak
    of --max_bad_steps bad steps that an earlier step completed (`halted`: the run stops at that step
    when the host next reads the flags). `source_losses` (several training sources) gets every
    micro-batch's per-token losses."""
    model, ctx, scaler = run.model, run.ctx, run.scaler
    halted = device_streak(run).stopped  # an earlier step completed --max_bad_steps bad steps in a row
    set_lr(run.optimizer, lr)
    local_loss = torch.zeros((), device=ctx.device)
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with run.parallel.micro_step(model, last):
            with autocast(ctx.device, run.dtype):
                out = model(**model_inputs(batch, ctx.device), num_items_in_batch=max(totals.loss_tokens, 1),
                            num_sequences_in_batch=max(totals.sequences, 1), skip_logits=True,
                            **({"return_token_losses": True} if source_losses else {}))
            if source_losses:
                source_losses.add_micro_batch(out.token_losses, batch)
            # x world_size undoes DDP's averaging: the gradient is the mean over all loss tokens (rows).
            objective = (out.loss + out.aux_loss) * ctx.world_size
            scaler.scale(objective).backward()
        local_loss += out.loss.detach().float()
    scaler.unscale_(run.optimizer)
    max_norm = run.args.grad_clip if run.args.grad_clip > 0 else float("inf")
    grad_norm = run.parallel.clip_grad_norm(max_norm)
    finite = torch.isfinite(grad_norm)
    if scaler.is_enabled():
        skip_also_where(scaler, run.optimizer, halted)
        scaler.step(run.optimizer)  # hands its found_inf to fused AdamW, which skips on the device
        scaler.update()
        restart_collapsed_scale(scaler, finite)
    else:
        step_unless(run.optimizer, ~finite | halted)
    run.optimizer.zero_grad(set_to_none=True)
    return StepResult(local_loss, grad_norm.detach(), finite)


def settle_gradient_layout(run: Run, batch: dict) -> None:
    """Before the run's first step (fresh or resumed): the parallelism's `settle_layout` with a forward and
    backward of zero on `batch` at hand (DDP runs it: trainer/parallel/ddp.py), so that every step of every
    run sums its gradients alike."""
    def backward_of_zero():
        with autocast(run.ctx.device, run.dtype):
            out = run.model(**model_inputs(batch, run.ctx.device), skip_logits=True)
        ((out.loss + out.aux_loss) * 0).backward()
    run.parallel.settle_layout(backward_of_zero)


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """optimizer.step(), a no-op on the device where `skip` is true: fused AdamW then leaves the
    weights, the moments and the step counter as they were (the GradScaler's protocol)."""
    optimizer.found_inf = skip.float()
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def settle(run: Run) -> None:
    """Read the steps' pending flags and whether the weights are finite: raises TrainingError for
    non-finite weights, and for --max_bad_steps bad steps in a row after saving the last good
    weights at the step that completed them (trainer/loop/health.py)."""
    stopped_at = read_steps(run)
    if stopped_at is not None:
        save(run)
        finish_saves(run)
        raise bad_steps_error(run, stopped_at)


def save_best(run: Run) -> None:
    """Rank 0 writes `<save_dir>/best/` (inference weights + best.json); a failed write stops every rank."""
    state, args = run.state, run.args
    error = None
    try:
        weights = run.parallel.inference_model(getattr(torch, args.save_dtype))  # collective under --fsdp 1
    except torch.OutOfMemoryError as failure:  # the gather of --fsdp 1, on every rank
        raise TrainingError(save_out_of_memory(run, failure, f"the save of {BEST_DIR}/")) from None
    if run.ctx.is_main:
        try:
            record = best_record(args.keep_best, state.best_value, state.best_step, state.best_measured_on)
            publish_inference_weights(weights, run.tokenizer, args.save_dir, getattr(torch, args.save_dtype),
                                              name=BEST_DIR, extra_files={BEST_FILE: record})
        except CheckpointError as failure:
            error = str(failure)
        except torch.OutOfMemoryError as failure:
            error = TrainingError(save_out_of_memory(run, failure, f"the save of {BEST_DIR}/"))
    del weights
    raise_on_every_rank(error, f"writing {BEST_DIR}/")


def evaluate_and_select(run: Run, steps_left: bool = True) -> bool:
    """Evaluate, log, keep the best model; True when early stopping says the run should end, which
    it says only where the run has `steps_left` (the last evaluation of a run that ends anyway stops
    nothing)."""
    state, args = run.state, run.args
    settle(run)
    # Rank 0's figures everywhere: every rank then takes the same keep/stop decision, bit for bit.
    with one_line_if_out_of_memory(run, f"the evaluation at step {state.step}", training=False):
        figures = broadcast_object(evaluate(run))
    new_best = stop = False
    if args.keep_best:
        new_best, stop = update_selection(state, args.keep_best, figures, args.early_stop_patience, run.measured_on)
        stop = stop and steps_left
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
    total_steps, resumed = count_total_steps(run), state.lr_schedule  # the checkpoint's schedule (None: fresh)
    warmup, named = run_warmup(args.warmup_steps, resumed, state.step, total_steps)
    state.lr_schedule = schedule_record(total_steps, warmup, args.learning_rate, args.min_lr_ratio)
    nothing_left = nothing_left_to_train(run, total_steps)  # said in place of the lines below: nothing is trained
    if not nothing_left and (too_long := warmup_too_long(warmup, named, total_steps, args.learning_rate)):
        logger.print(too_long)
    if args.max_steps > total_steps > state.step:  # the epochs end first: --max_steps is capped, said
        logger.print(f"warning: --max_steps {args.max_steps} is more than the {format_count(total_steps, 'optimizer step')} of --epochs "
                     f"{args.epochs}: the run ends at step {total_steps} (raise --epochs to train longer)")
    if not nothing_left and (note := warmup_afresh(args.warmup_steps, resumed, state.step, named, total_steps)):
        logger.print(note)
    if not nothing_left and (note := schedule_change(state.step, run.resumed_lr, resumed, state.lr_schedule)):
        logger.print(note)
    run.model.train()
    logger.print(nothing_left or (
        f"training {format_count(total_steps, 'optimizer step')} from step {state.step}: "
        f"{format_count(run.ctx.world_size, 'process', 'processes')} x "
        f"batch {args.batch_size} x accumulation {args.accumulation_steps}, dtype {str(run.dtype).split('.')[-1]}, "
        f"device {run.ctx.device}{short_last_step(run)}"))
    interval = {"loss": torch.zeros((), device=run.ctx.device), "start": time.time(),
                "throughput": Throughput(run.ctx.device, run.dtype, run.ctx.world_size),
                "run_start": time.time(), "run_first_step": state.step,
                # a resume off the log grid: the first window averages only the steps since then
                "resumed_at": state.step if state.step % args.log_interval else None,
                # several training sources: their losses per log window
                "sources": SourceLosses(run.data.source_names, run.ctx.device) if len(run.data.source_names) > 1 else None}
    last_saved = last_eval = last_logged = state.step
    run.save_clock = SaveClock(args.save_every_minutes if run.ctx.is_main else 0.0)  # rank 0's clock decides
    status, layout_settled = "finished", False
    while not nothing_left and state.step < total_steps and state.epoch < args.epochs:
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
            if not layout_settled:  # several processes: the first forward and backward of the run's batches
                with one_line_if_out_of_memory(run, f"step {state.step + 1}"):
                    settle_gradient_layout(run, micro_batches[0])
                layout_settled = True
            lr = cosine_lr(state.step, total_steps, args.learning_rate, warmup, args.min_lr_ratio)
            result = take_step(run, micro_batches, interval, lr)
            if result is None:
                status = "preempted"
                break
            taken = (result.grad_norm, lr)  # the last step's: a window that a stop cuts short logs them
            log_due = state.step % args.log_interval == 0 or state.step == total_steps
            if state.step == interval["run_first_step"] + 1:
                first_step_done(run, interval)
            if log_due:
                log_interval(run, interval, *taken, total_steps)
                last_logged = state.step
            eval_due = bool(run.eval_sets and args.eval_interval and state.step % args.eval_interval == 0)
            save_due = bool(args.save_interval and state.step % args.save_interval == 0) or run.save_clock.agreed
            if eval_due or save_due:  # the steps queued on a GPU are training: the pause starts once they are done
                wait_for_device(run.ctx.device)
            paused = time.time()  # evaluations and saves are no training: left out of the window's tokens/s
            if eval_due:
                last_eval = state.step
                if evaluate_and_select(run, steps_left=state.step < total_steps):
                    status = "early_stopped"
                    interval["start"] += time.time() - paused
                    break
            if save_due:
                save(run)
                run.save_clock.saved()
                last_saved = state.step
            interval["start"] += time.time() - paused
            if state.samples_in_epoch == 0:
                break  # epoch finished: the outer loop starts the next one
        if status != "finished":
            break
    if status != "finished" and last_logged != state.step:  # the steps since the last line are logged too
        log_interval(run, interval, *taken, total_steps)
    if status == "preempted":
        logger.print(f"{run.preemption.reason or 'a stop signal (on another rank)'} received: stopping at step {state.step} and saving a resume checkpoint")
    elif run.eval_sets and last_eval != state.step:
        evaluate_and_select(run, steps_left=False)
    if last_saved != state.step or status == "preempted" or state.step == 0:
        save(run)
    finish_saves(run)
    return status


def take_step(run: Run, micro_batches: list[dict], interval: dict, lr: float) -> StepResult | None:
    """One optimizer step as the loop takes it between log lines: the ranks agree on the counts,
    the step runs, its flags and loss join the log window on the device. None: stop now (preemption)."""
    state = run.state
    totals = agree_on_step(run, micro_batches, run.save_clock.due())
    run.save_clock.agreed = totals.save
    if totals.stop:
        return None
    with one_line_if_out_of_memory(run, f"step {state.step + 1}"):
        result = optimizer_step(run, micro_batches, totals, lr, source_losses=interval["sources"])
    if interval["sources"]:
        interval["sources"].end_step(totals.loss_tokens, result.finite)
    state.step += 1
    state.samples_in_epoch += sum(len(mb["input_ids"]) for mb in micro_batches) * run.ctx.world_size
    if state.samples_in_epoch >= len(run.data.dataset):
        state.epoch, state.samples_in_epoch = state.epoch + 1, 0
    record_step(run, result.finite, lr)
    interval["loss"] += torch.where(result.finite, result.loss, 0.0)  # a skipped step's loss is left out
    interval["throughput"].add(totals.real_tokens, totals.flops)
    return result


def first_step_done(run: Run, interval: dict) -> None:
    """Record the process's first step, which the throughput and the ETA leave out (throughput.py),
    once the device has done it."""
    wait_for_device(run.ctx.device)
    interval["throughput"].first_step_done(time.time() - interval["start"])


def wait_for_device(device: torch.device) -> None:
    """Wait until `device` has done the work queued on it, where the loop's clock must stop at the end
    of the training work (the first step; before an evaluation or a save, whose time is left out of the
    window's): a GPU runs the steps the host has queued after the host has moved on, a CPU's step is
    done when its call returns."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def log_interval(run: Run, interval: dict, grad_norm: torch.Tensor, lr: float, total_steps: int) -> None:
    """Read the window's flags and reduce its loss over ranks (the log line's host reads), then report."""
    state = run.state
    settle(run)
    finite = run.health.take_window()
    steps = sum(finite)
    loss_sum = all_reduce_sum(interval["loss"].clone()).item()
    elapsed = max(time.time() - interval["start"], 1e-9)
    seconds_per_step = interval["throughput"].seconds_per_step(  # ETA from the run's average
        time.time() - interval["run_start"], state.step - interval["run_first_step"])
    norm = float(grad_norm)
    figures = {  # None (JSON null) rather than NaN: every step was skipped / the last norm was not finite
        "loss": loss_sum / steps if steps else None,
        "lr": lr,
        "grad_norm": norm if math.isfinite(norm) else None,
        # tokens_per_s, model_tflops_per_s, first_step_s where it is left out; on a GPU mfu, max_memory_gib
        **interval["throughput"].figures(elapsed, len(finite)),
        "skipped_steps": state.skipped_steps,
        **(interval["sources"].figures(finite) if interval["sources"] else {}),  # loss/<source>, loss_tokens/<source>, ...
    }
    if interval["resumed_at"] is not None:  # a shorter window than --log_interval: said on the line and the row
        figures.update(resumed_at_step=interval["resumed_at"], loss_steps=steps)
        interval["resumed_at"] = None
    shown_epoch = state.epoch - 1 if state.samples_in_epoch == 0 else state.epoch  # a step that ends an epoch is of it
    run.logger.log_train(state.step, total_steps, shown_epoch, run.args.epochs, figures,
                         eta_s=seconds_per_step * (total_steps - state.step))
    interval.update(loss=torch.zeros((), device=run.ctx.device), start=time.time())
