"""The run's state: `Run` (everything the loop needs, built once by train_full_sft.py), `TrainState`
(where the run is), and the resume checkpoint's content in (`restore`) and out (`resume_state`)."""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from model.flops import ModelFlops
from trainer import run_identity
from trainer.checkpoint.background import BackgroundWriter
from trainer.checkpoint.resume import left_by_a_rollback
from trainer.checkpoint.sharded import is_sharded, read_full
from trainer.checkpoint.save_dir import (
    BEST_DIR, Claim, best_record_on_disk, new_run_id, run_label, set_aside, set_aside_later_checkpoints,
)
from trainer.data_setup import TrainData
from trainer.errors import CheckpointError, TrainingError, first_line
from trainer.evaluation.evaluate import EvalSet
from trainer.evaluation.selection import measured_on, measured_with, same_measurement
from trainer.loop.health import StepHealth
from trainer.loop.lr_schedule import recorded_schedule, unrecorded_schedule
from trainer.loop.out_of_memory import ran_out_of_memory, resume_out_of_memory
from trainer.loop.save_clock import SaveClock
from trainer.model_setup import group_settings, keep_run_settings
from trainer.parallel import Parallelism
from trainer.parallel.ddp import unwrap
from trainer.run_logger import RunLogger, format_count
from trainer.runtime.distributed import DistContext, all_gather_objects, rank0_value
from trainer.runtime.precision import scaler_state_for_resume
from trainer.runtime.preemption import PreemptionFlag
from trainer.runtime.seeding import capture_rng_state, restore_rng_state, setup_seed
from trainer.weights.read import EMBED, LM_HEAD, misfit, tie_difference, with_tied_head
from trainer.weights.tokenizer import checkpoint_record


@dataclass
class TrainState:
    """Where the run is. Saved in every resume checkpoint."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    samples_in_epoch: int = 0  # global (all ranks) samples of this epoch already consumed
    skipped_steps: int = 0
    bad_steps_in_a_row: int = 0
    wandb_run_id: str | None = None
    run_id: str = field(default_factory=new_run_id)  # one line of training, kept across resumes in its save_dir
    forked_from: dict | None = None  # {run_id, step, checkpoint} of the run it forked (save_dir.Claim); None: none
    rolled_back_from: dict | None = None  # {run_id, step} of the line a rollback left (take_save_dir); None: none
    best_metric: str | None = None  # the --keep_best metric the best value below is of
    best_value: float | None = None  # of that metric, and the step that reached it
    best_step: int | None = None
    best_measured_on: list[str] | None = None  # the held-out data's keys (selection.measured_on); None: unknown
    evals_without_improvement: int = 0
    # The learning rate schedule the run trains on (lr_schedule.schedule_record, set by the loop at every start),
    # whose warmup its resumes keep (lr_schedule.run_warmup); a checkpoint without it: the one its flags give
    # (lr_schedule.unrecorded_schedule); None: not started yet, or a checkpoint whose flags give none.
    lr_schedule: dict | None = None


@dataclass
class Run:
    """Everything the loop needs, built by `train_full_sft.py`."""

    args: argparse.Namespace  # as parsed; never changed afterwards
    ctx: DistContext
    model: torch.nn.Module  # possibly DDP- and/or compile-wrapped
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    dtype: torch.dtype
    data: TrainData
    eval_sets: list[EvalSet]  # one per held-out file; empty without --eval_data_path
    tokenizer: PreTrainedTokenizerBase
    logger: RunLogger
    preemption: PreemptionFlag
    parallel: Parallelism  # how the processes share the model (DDP or FSDP)
    tokenizer_path: str | None = None  # where the tokenizer came from (None: the shipped one)
    state: TrainState = field(default_factory=TrainState)
    health: StepHealth = field(default_factory=StepHealth)  # the steps' flags on the device, not read yet
    writer: BackgroundWriter = field(default_factory=BackgroundWriter)  # the saves' writer thread
    save_clock: SaveClock = field(default_factory=SaveClock)  # --save_every_minutes (set by the loop)
    resumed_lr: float | None = None  # the learning rate of the resume checkpoint's last step (None: no step)

    @functools.cached_property
    def tokenizer_record(self) -> dict:
        """The run's tokenizer files and fingerprint for its checkpoints: written out once, at the first
        save, so a later save writes nothing but its own files (a full disk then fails that file)."""
        return checkpoint_record(self.tokenizer)

    @functools.cached_property
    def measured_on(self) -> list[str] | None:
        """What this run's --keep_best metric is measured on (selection.measured_on); None without one."""
        args = self.args
        return measured_on(self.eval_sets, args.keep_best, args.eval_max_new_tokens) if args.keep_best else None

    @property
    def raw_model(self):
        return unwrap(self.model)

    @functools.cached_property
    def model_flops(self) -> ModelFlops:
        """The FLOPs of this model's training work, per token, logit and attention pair (model/flops.py)."""
        return ModelFlops(self.raw_model)


# --------------------------------------------------------------------------- resume


def resume_state(run: Run) -> dict:
    """The resume checkpoint's content (collective: every rank contributes its RNG state)."""
    rng_states = all_gather_objects(capture_rng_state(run.ctx.device))
    state = run.state
    return {
        "model_config": run.raw_model.config.to_dict(),
        **run.parallel.training_state(run.optimizer),  # "model" and "optimizer" (sharded under --fsdp 1)
        "scaler": run.scaler.state_dict(),
        "step": state.step,
        "epoch": state.epoch,
        "samples_in_epoch": state.samples_in_epoch,
        "skipped_steps": state.skipped_steps,
        "bad_steps_in_a_row": state.bad_steps_in_a_row,
        "best_metric": state.best_metric,
        "best_value": state.best_value,
        "best_step": state.best_step,
        "best_measured_on": state.best_measured_on,
        "evals_without_improvement": state.evals_without_improvement,
        "lr_schedule": state.lr_schedule,
        "rng": rng_states,
        "world_size": run.ctx.world_size,
        "args": {**vars(run.args), "tokenizer_path": run.tokenizer_path},  # the directory it was loaded from
        "tokenizer": run.tokenizer_record,  # the run's own copy, what every reader of it loads
        "sample_stream": run_identity.recorded(run.data.identity, run.data.sampler.epoch_group_size(state.epoch)),
        "run_id": state.run_id,
        "forked_from": state.forked_from,
        "rolled_back_from": state.rolled_back_from,
        "wandb_run_id": run.logger.wandb_run_id,
    }


def restore(run: Run, saved: dict, claim: Claim) -> None:
    """Load a validated resume checkpoint into the run (model, optimizer, scaler, RNG, position); a fork
    (`claim`) gets a run id of its own. Nothing in --save_dir moves here (`take_save_dir`).

    A resume that changes a fact of the sample stream is refused (every rank holds the same identity,
    so every rank refuses); another global batch or grouping finishes the interrupted epoch in the
    checkpoint's order (trainer/run_identity.py)."""
    problem = run_identity.check_and_pin(saved, run.data.identity, run.args.save_dir, run.data.sampler,
                                         run.logger.print)
    if problem:
        raise CheckpointError(problem)
    tied = run.raw_model.config.tie_word_embeddings
    if is_sharded(saved):  # names and shapes from the index; the tie's two tensors read by rank 0 alone
        path = saved["sharded_path"]
        problems = misfit(run.raw_model.state_dict(), read_full(path, "model", only=()), tied,
                          read_tie=lambda: sharded_tie_difference(path, run.ctx.is_main))
    else:
        problems = misfit(run.raw_model.state_dict(), saved["model"], tied)
    if problems:
        raise CheckpointError(f"resume checkpoint does not fit this run: {problems}")
    if not is_sharded(saved):
        saved["model"] = with_tied_head(saved["model"], tied)
    settings = group_settings(run.optimizer)  # this run's flags: the load replaces them with the checkpoint's
    try:
        run.parallel.load_training_state(run.optimizer, saved)
    except CheckpointError:
        raise  # one line naming the checkpoint already
    except (RuntimeError, ValueError, KeyError) as error:
        if isinstance(error, RuntimeError) and ran_out_of_memory(error):  # the device, not the checkpoint
            raise TrainingError(resume_out_of_memory(run.ctx.device, error)) from None
        raise CheckpointError(f"resume checkpoint does not fit this run: {first_line(error)}") from error
    if saved["step"] == 0:
        # No optimizer step has been taken: the optimizer goes on without state, as in the run that wrote
        # the checkpoint. A load through torch's state-dict API (into a fully_shard-ed model, or from a
        # sharded checkpoint) steps an optimizer without state at learning rate 0 to give it one (AdamW's
        # counter at 1), which an empty saved state (a one-process or DDP file's) leaves in place.
        run.optimizer.state.clear()
    else:
        run.resumed_lr = run.optimizer.param_groups[0]["lr"]  # the checkpoint's, before this run's settings
    keep_run_settings(run.optimizer, settings)
    if saved.get("scaler") and run.scaler.is_enabled():
        run.scaler.load_state_dict(scaler_state_for_resume(saved["scaler"], run.logger.print))
    if saved["world_size"] == run.ctx.world_size:
        restore_rng_state(saved["rng"][run.ctx.rank], run.ctx.device)
    else:
        # Same sample stream, new per-rank randomness (dropout) for the new world size.
        setup_seed(run.args.seed + run.ctx.rank + saved["step"])
        run.logger.print(
            f"resuming a {saved['world_size']}-process run on {format_count(run.ctx.world_size, 'process', 'processes')} at "
            f"epoch {saved['epoch'] + 1}, sample {saved['samples_in_epoch']}"
        )
    fork = claim.forked_from
    run.state = TrainState(
        step=saved["step"], epoch=saved["epoch"], samples_in_epoch=saved["samples_in_epoch"],
        skipped_steps=saved.get("skipped_steps", 0), bad_steps_in_a_row=saved.get("bad_steps_in_a_row", 0),
        wandb_run_id=None if fork else saved.get("wandb_run_id"),
        run_id=run.state.run_id if fork else saved.get("run_id") or run.state.run_id,
        forked_from=fork or saved.get("forked_from"),
        rolled_back_from=None if fork else saved.get("rolled_back_from"),
        best_metric=saved_best_metric(saved), best_value=saved.get("best_value"), best_step=saved.get("best_step"),
        best_measured_on=saved.get("best_measured_on"),
        evals_without_improvement=saved.get("evals_without_improvement", 0),
        lr_schedule=recorded_schedule(saved.get("lr_schedule"))
        or unrecorded_schedule(saved, run.data.sampler.dataset_len, run.resumed_lr),
    )


def sharded_tie_difference(path: str, is_main: bool) -> str | None:
    """`tie_difference` of the sharded checkpoint `path`'s lm_head and embedding, read and compared by
    rank 0 alone (each a vocabulary x hidden tensor: every rank reading both would take that much host
    memory on each) and shared with every rank through the store (`rank0_value`), so every rank refuses
    with the same one line; a read that fails is that line (a CheckpointError) on every rank."""
    verdict = None
    if is_main:
        try:
            verdict = {"differs": tie_difference(read_full(path, "model", only=(LM_HEAD, EMBED)))}
        except CheckpointError as error:
            verdict = {"unreadable": str(error)}
    verdict = rank0_value(verdict, f"comparing the lm_head and embedding of {path}")
    if "unreadable" in verdict:
        raise CheckpointError(verdict["unreadable"])
    return verdict["differs"]


def take_save_dir(run: Run, claim: Claim, resumed: bool) -> None:
    """Take --save_dir as `claim` says, once every check of the run has passed (train_full_sft.py): rank 0
    sets the previous run's files aside, so a refused run leaves them where they are. A run `resumed` from
    a checkpoint earlier than the directory's later checkpoints then rolls back (the new line of training,
    with a run id of its own, must outlive them: they are set aside too); a fork says so in one line; and a
    selection that cannot go on starts afresh (`restart_incomparable_selection`)."""
    if run.ctx.is_main:
        claim.carry_out(run.logger.print)
    if not resumed:
        return
    if run.ctx.is_main and (set_aside_later_checkpoints(run.args.save_dir, run.state.step, run.logger.print)
                            or rolled_back_before(run)):
        if not claim.forked_from:  # a fork's line is named by its forked_from
            run.state.rolled_back_from = {"run_id": run.state.run_id, "step": run.state.step}
        run.state.run_id = new_run_id()
    if run.state.rolled_back_from:  # said by the first row of every start of the line: its first may have none
        run.logger.origin["rolled_back_from"] = run.state.rolled_back_from
    fork = claim.forked_from
    if fork:
        own = "a run id and a wandb run" if run.args.use_wandb else "a run id"
        run.logger.print(f"fork: {fork['checkpoint']} is of run {run_label(fork['run_id'])}, which "
                         f"{run.args.save_dir} does not hold: this run goes on from its step {fork['step']} as run "
                         f"{run.state.run_id}, with {own} of its own")
    restart_incomparable_selection(run, fork)


def rolled_back_before(run: Run) -> bool:
    """Whether a rollback to this run's step left the resumed line's later checkpoints in set_aside/
    (trainer/checkpoint/resume.py:left_by_a_rollback), said in one line: this run is a new line too."""
    folder = left_by_a_rollback(run.args.save_dir, run.state.run_id, run.state.step)
    if folder:
        run.logger.print(f"resuming at step {run.state.step}, where a rollback left run {run_label(run.state.run_id)}'s "
                         f"later checkpoints ({folder}): this run is a new line of training, as that rollback was")
    return bool(folder)


def saved_best_metric(saved: dict) -> str | None:
    """The metric a checkpoint's best value is of: recorded since `best_metric` exists, else the
    --keep_best of the run that wrote it."""
    if "best_metric" in saved:
        return saved["best_metric"]
    return (saved.get("args") or {}).get("keep_best") if saved.get("best_value") is not None else None


def best_on_disk_differs(run: Run) -> tuple[str, str] | None:
    """(what it is of, a name for the folder it is moved to) when `<save_dir>/best/best.json` records
    another metric than --keep_best, or other held-out data (or generated answers) than this run's; else None."""
    record = best_record_on_disk(run.args.save_dir)
    metric, data = record.get("metric"), record.get("measured_on")
    if isinstance(metric, str) and metric != run.args.keep_best:
        return f"of {metric}", "best-of-" + metric.replace("/", "-")
    if isinstance(data, list) and not same_measurement(data, run.measured_on):
        what = measured_with(run.args.keep_best)[0]
        return f"of other {what}", "best-of-other-" + what.replace(" ", "-")
    return None


def restart_incomparable_selection(run: Run, fork: dict | None) -> None:
    """A resume with another --keep_best than the checkpoint's best is of, or with other held-out data
    (or, for the scores of generated answers, other --eval_generate_samples or --eval_max_new_tokens)
    than it was measured on (`Run.measured_on`; a checkpoint that records none is taken as measured on
    this run's): values of two metrics, or of one metric on two held-out sets, cannot be compared (an
    accuracy of 0.28 never "improves" on a loss of 8.38), so the selection starts afresh (every rank)
    and rank 0 moves the best/ of the other metric or data aside; one line says so. A `fork` starts it
    afresh whatever its flags: the checkpoint's best is in the best/ of the forked run's directory, and
    the fork keeps its own best/ in its --save_dir (a fork without --keep_best keeps no best to compare
    a later resume's evaluations with)."""
    metric, state = run.args.keep_best, run.state
    if not metric:  # no selection in this run: the checkpoint's best is kept for a later resume with its metric
        if fork:
            start_selection_afresh(state)
        return
    notes = []
    if state.best_metric not in (None, metric):
        notes.append(f"the checkpoint's best is of {state.best_metric} ({state.best_value:.4f} at step "
                     f"{state.best_step}), which {metric} cannot be compared with: the selection starts afresh")
    elif state.best_value is not None and state.best_measured_on is not None and not same_measurement(
            state.best_measured_on, run.measured_on):
        what, flags = measured_with(metric)
        notes.append(f"the checkpoint's best ({state.best_value:.4f} at step {state.best_step}) was measured on "
                     f"other {what} than this run's {flags}: the selection starts afresh")
    elif fork and state.best_value is not None:
        notes.append(f"the checkpoint's best ({state.best_value:.4f} at step {state.best_step}) is in the best/ of "
                     f"run {run_label(fork['run_id'])}, not in this fork's --save_dir: the selection starts afresh")
    if notes:
        start_selection_afresh(state)
    if run.ctx.is_main:
        differs = best_on_disk_differs(run)
        if differs:
            folder = set_aside(run.args.save_dir, [os.path.join(run.args.save_dir, BEST_DIR)], differs[1])
            notes.append(f"its best/ ({differs[0]}) moved to {folder}")
    if notes:
        run.logger.print(f"--keep_best {metric}: " + "; ".join(notes))


def start_selection_afresh(state: TrainState) -> None:
    """Forget the best evaluation so far: the next evaluation is the best."""
    state.best_metric = state.best_value = state.best_step = state.best_measured_on = None
    state.evals_without_improvement = 0
