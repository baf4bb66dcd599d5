"""The one reader of resume checkpoints, whichever format wrote them: a single file
(`step_*.pt`, trainer/checkpoint/single_file.py) or a sharded directory (`step_*.dcp`, `--fsdp 1`,
trainer/checkpoint/sharded.py). It validates the format, finds the newest readable checkpoint of a
run, and refuses one whose architecture differs from the run's."""

import itertools
import os

from trainer.checkpoint import sharded, single_file
from trainer.checkpoint.save_dir import (
    SET_ASIDE_DIR, SHARDED_SUFFIX, Claim, checkpoints_dir, claim_for_fresh_run, list_checkpoints, logged_rows, run_label,
    set_aside_by_rollbacks_to,
)
from trainer.errors import CheckpointError

REQUIRED_KEYS = ("model_config", "model", "optimizer", "step", "epoch", "samples_in_epoch", "rng", "world_size", "args")
# Fields that change the shapes or the mathematics of the network.
ARCHITECTURE_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "use_moe", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "tie_word_embeddings", "rope_theta", "rope_yarn", "rms_norm_eps", "norm_topk_prob",
    "router_aux_loss_coef",
)
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef")


def load_resume_checkpoint(path: str, required=REQUIRED_KEYS) -> dict:
    """Read and validate a resume checkpoint of either format; never unpickles arbitrary objects.
    `required` names the entries the caller needs (inference needs only the model and its config).
    The tensors are memory-mapped (single file) or read when loaded into the model (sharded)."""
    if os.path.isdir(path):
        if path.rstrip("/").endswith(SHARDED_SUFFIX):
            return sharded.load_meta(path, required)
        raise CheckpointError(f"resume checkpoint {path} is a directory: give a step_*.pt file inside its "
                              "checkpoints/, or --from_resume 1 with --save_dir set to the run directory")
    return single_file.load(path, required)


def find_resume_checkpoint(save_dir: str, log=print) -> tuple[str, dict] | None:
    """The newest readable checkpoint in `save_dir`; unreadable newer ones are skipped with a message.

    None when there is no checkpoint at all; a CheckpointError when there are some but none can be
    read (starting from scratch would then overwrite the run's model/), or when the newest readable
    one is of a run that nothing else in `save_dir` records (`check_of_the_dirs_runs`)."""
    found = list_checkpoints(save_dir)
    for path in found:
        try:
            saved = load_resume_checkpoint(path)
        except CheckpointError as error:
            log(f"warning: skipping unusable checkpoint: {error}; falling back to the previous one")
            continue
        check_of_the_dirs_runs(save_dir, path, saved)
        return path, saved
    if found:
        raise CheckpointError(
            f"none of the {len(found)} resume checkpoint(s) in {checkpoints_dir(save_dir)} can be read (see the "
            f"warnings above); to go on from the last saved weights start a new run with --from_weight "
            f"{os.path.join(save_dir, 'model')} --save_dir NEW_DIR, or move the damaged checkpoints away"
        )
    return None


def check_of_the_dirs_runs(save_dir: str, path: str, saved: dict) -> None:
    """Refuse the checkpoint `path` (`saved`), the newest readable one of `save_dir`, when its run id
    is recorded by no other checkpoint and no metrics.jsonl row there while they record other runs:
    a checkpoint of another run copied into checkpoints/. Continued, it would go on as that run in
    this directory, its saves would rotate this run's checkpoints away and replace its model/. A
    directory that records no other run (a run's first save), or a checkpoint without a run id, is
    taken as it is; so is the first checkpoint of a new line where the directory records the line it
    comes from, as its first checkpoint may come before its first row: a rollback's where a record
    names the run it left (`rolled_back_from`), a fork's tried again where a record names the same
    `forked_from`."""
    run_id = saved.get("run_id")
    if run_id is None:
        return
    own = {run_id}
    left, fork = saved.get("rolled_back_from"), saved.get("forked_from")
    if isinstance(left, dict) and isinstance(left.get("run_id"), str):
        own.add(left["run_id"])
    if not (isinstance(fork, dict) and {"run_id", "step", "checkpoint"} <= fork.keys()):
        fork = None
    others = set()
    earlier = (other for other in list_checkpoints(save_dir) if other != path)
    records = itertools.chain(logged_rows(save_dir), map(checkpoint_record, earlier))
    for record in records:
        if record.get("run_id") in own or (fork and same_origin(record.get("forked_from"), fork)):
            return
        if isinstance(record.get("run_id"), str):
            others.add(record["run_id"])
    if others:
        raise CheckpointError(
            f"the newest checkpoint {path} is of run {run_id}, which no other checkpoint or metrics.jsonl row "
            f"in {save_dir} records (they are of run {', '.join(sorted(others))}): a checkpoint of another run "
            f"copied in? --from_resume 1 would continue that run here, rotate this run's checkpoints away and "
            f"replace its model/; move it out of {checkpoints_dir(save_dir)}, or give --resume_from {path} to "
            "continue it here")


def claim_for_resume(save_dir: str, path: str, saved: dict, overwrite: bool, pth_name: str | None = None) -> Claim:
    """--resume_from `path` (its checkpoint `saved`) into `save_dir`: the one rule that decides whether the
    directory holds the run of the checkpoint, so that this run goes on as that run, or this run is a fork.
    A run id (trainer/loop/state.py) names a line of training and is kept across resumes in its directory; a
    rollback's new line (a run id of its own) writes beside the checkpoints and metrics.jsonl rows of the
    line it left. So the checkpoint is

    - of the directory's run where it lies in the directory's checkpoints/, or a checkpoint or a row there
      names its run id (`held_as`): this run goes on as that run;
    - of the directory's fork where a checkpoint or a row there records it as their `forked_from` (the same
      --resume_from once more, after a crash): a fork again (a new run id), in the directory of its earlier
      try, whose later checkpoints and best/ the rollback of trainer/loop/state.py:take_save_dir sets aside;
    - else of another run, a fork's own or one of a checkpoint that records no run id: this run is a fork, a
      line of training of its own (a new run id, a new wandb run), whose `forked_from` names where it comes
      from. Kept under the checkpoint's run id, two directories would hold two diverging lines of one run: a
      later resume of one's checkpoint into the other would be taken as that directory's own, and its
      rotation would delete the other line's checkpoints. Only a checkpoint in the directory's set_aside/ (a
      run that --overwrite 1 replaced there) is no fork: it goes on as its run, back in its directory.
      Either way the directory is claimed as by a fresh run (`claim_for_fresh_run`): one that holds another
      run is refused unless --overwrite 1, since this run's rotation would delete that run's checkpoints and
      its saves replace its model.

    Anything else under the directory (a run directory inside it) is no part of its run."""
    run_id = saved.get("run_id")
    origin = {"run_id": run_id, "step": saved["step"], "checkpoint": os.path.abspath(path)}
    real = os.path.realpath(path)
    held = "run" if os.path.dirname(real) == os.path.realpath(checkpoints_dir(save_dir)) \
        else held_as(save_dir, run_id, origin)
    if held:
        return Claim(save_dir, forked_from=origin if held == "fork" else None)
    claim = claim_for_fresh_run(save_dir, overwrite, pth_name=pth_name, resumed=run_label(run_id))
    if not is_inside(real, os.path.join(save_dir, SET_ASIDE_DIR)):
        claim.forked_from = origin
    return claim


def held_as(save_dir: str, run_id: str | None, origin: dict) -> str | None:
    """"run" where a metrics.jsonl row or a readable checkpoint of `save_dir` names the run `run_id`, "fork"
    where one records `origin` ({run_id, step, checkpoint}) as its `forked_from`, else None. The
    checkpoints are read only where no row tells, newest first, up to the first that tells."""
    def tells(record: dict) -> str | None:
        if run_id is not None and record.get("run_id") == run_id:
            return "run"
        return "fork" if same_origin(record.get("forked_from"), origin) else None

    records = itertools.chain(logged_rows(save_dir), map(checkpoint_record, list_checkpoints(save_dir)))
    return next(filter(None, map(tells, records)), None)


def same_origin(recorded, origin: dict) -> bool:
    """Whether the `forked_from` `recorded` names the checkpoint of `origin`: its run, its step, its file
    (real paths: through symlinks)."""
    return (isinstance(recorded, dict) and isinstance(recorded.get("checkpoint"), str)
            and (recorded.get("run_id"), recorded.get("step")) == (origin["run_id"], origin["step"])
            and os.path.realpath(recorded["checkpoint"]) == os.path.realpath(origin["checkpoint"]))


def left_by_a_rollback(save_dir: str, run_id: str | None, step: int) -> str | None:
    """The set_aside/ folder where a rollback to `step` put checkpoints of the run `run_id` past it (the
    first such), else None. A run that resumes that run at that step again goes on from where the old
    line was left, so it is a rollback too, with no later checkpoint left to set aside: the rollback's
    command once more after it stopped before its first checkpoint, or --from_resume 1 finding that
    step the newest checkpoint."""
    if run_id is None:
        return None
    left = (path for path in set_aside_by_rollbacks_to(save_dir, step) if checkpoint_record(path).get("run_id") == run_id)
    found = next(left, None)
    return os.path.dirname(os.path.dirname(found)) if found else None


def checkpoint_record(path: str) -> dict:
    """The non-tensor entries of the resume checkpoint `path` ({} where it cannot be read)."""
    try:
        return load_resume_checkpoint(path, required=())
    except CheckpointError:
        return {}


def is_inside(path: str, folder: str) -> bool:
    """Whether `path` lies in `folder` (real paths: through symlinks)."""
    real = os.path.realpath(folder)
    return os.path.commonpath([os.path.realpath(path), real]) == real


def check_model_config(saved: dict, current) -> None:
    """Refuse a checkpoint whose architecture differs from the one the flags describe."""
    current_dict = current.to_dict()
    fields = ARCHITECTURE_FIELDS
    if not saved.get("use_moe") and not current_dict.get("use_moe"):
        fields = [name for name in fields if name not in MOE_FIELDS]
    differing = [
        f"{name} (checkpoint {saved.get(name)!r}, flags {current_dict.get(name)!r})"
        for name in fields
        if saved.get(name) != current_dict.get(name)
    ]
    if differing:
        raise CheckpointError("checkpoint model config differs from the flags: " + "; ".join(differing))
