"""The one reader of resume checkpoints, whichever format wrote them: a single file
(`step_*.pt`, trainer/checkpoint/single_file.py) or a sharded directory (`step_*.dcp`, `--fsdp 1`,
trainer/checkpoint/sharded.py). It validates the format, finds the newest readable checkpoint of a
run, and refuses one whose architecture differs from the run's."""

import os

from trainer.checkpoint import sharded, single_file
from trainer.checkpoint.save_dir import (
    Claim, checkpoints_dir, claim_for_fresh_run, list_checkpoints, logged_run_ids,
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
        if path.rstrip("/").endswith(sharded.SUFFIX):
            return sharded.load_meta(path, required)
        raise CheckpointError(f"resume checkpoint {path} is a directory: give a step_*.pt file inside its "
                              "checkpoints/, or --from_resume 1 with --save_dir set to the run directory")
    return single_file.load(path, required)


def find_resume_checkpoint(save_dir: str, log=print) -> tuple[str, dict] | None:
    """The newest readable checkpoint in `save_dir`; unreadable newer ones are skipped with a message.

    None when there is no checkpoint at all; a CheckpointError when there are some but none can be
    read (starting from scratch would then overwrite the run's model/)."""
    found = list_checkpoints(save_dir)
    for path in found:
        try:
            return path, load_resume_checkpoint(path)
        except CheckpointError as error:
            log(f"warning: skipping unusable checkpoint: {error}; falling back to the previous one")
    if found:
        raise CheckpointError(
            f"none of the {len(found)} resume checkpoint(s) in {checkpoints_dir(save_dir)} can be read (see the "
            f"warnings above); to go on from the last saved weights start a new run with --from_weight "
            f"{os.path.join(save_dir, 'model')} --save_dir NEW_DIR, or move the damaged checkpoints away"
        )
    return None


def claim_for_resume(save_dir: str, path: str, saved: dict, overwrite: bool, pth_name: str | None = None) -> Claim:
    """--resume_from `path` (its checkpoint `saved`) into `save_dir`. A checkpoint's run id (trainer/loop/state.py)
    is kept across resumes in its directory, and a rollback's new line of training writes beside the checkpoints
    and the metrics.jsonl rows of the line it left: a directory where neither a checkpoint nor a row names the
    id holds another run, claimed as by a fresh run (`claim_for_fresh_run`), since this run's rotation would
    delete that run's checkpoints and its saves replace its model. A checkpoint without a run id is resumed
    without that check: nothing tells its run.

    A checkpoint from outside `save_dir` of a run that `save_dir` does not hold starts a fork there: a line of
    training of its own (a new run id, a new wandb run), whose `forked_from` names where it comes from. Kept
    under the checkpoint's run id, two directories would hold two diverging lines of one run: a later resume
    of one's checkpoint into the other would be taken as that directory's own, and its rotation would delete
    the other line's checkpoints."""
    run_id = saved.get("run_id")
    in_checkpoints = os.path.realpath(os.path.dirname(path)) == os.path.realpath(checkpoints_dir(save_dir))
    held = run_id is not None and (in_checkpoints or holds_run(save_dir, run_id))
    claim = claim_for_fresh_run(save_dir, overwrite, pth_name=pth_name, resumed=run_id) \
        if run_id is not None and not held else Claim(save_dir)
    if not held and not is_inside(path, save_dir):
        claim.forked_from = {"run_id": run_id, "step": saved["step"], "checkpoint": os.path.abspath(path)}
    return claim


def holds_run(save_dir: str, run_id: str) -> bool:
    """Whether a metrics.jsonl row or a readable checkpoint of `save_dir` names the run `run_id`; the
    checkpoints are read only where no row names it, newest first, up to the first that names it."""
    if run_id in logged_run_ids(save_dir):
        return True
    return any(checkpoint_run_id(path) == run_id for path in list_checkpoints(save_dir))


def checkpoint_run_id(path: str) -> str | None:
    """The run id that the resume checkpoint `path` records; None where it records none or cannot be read."""
    try:
        return load_resume_checkpoint(path, required=()).get("run_id")
    except CheckpointError:
        return None


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
