"""Load a trained MiniMind model (and its tokenizer) for inference, from any place training writes one.

Accepted ``path`` kinds:

(a) an HF directory: ``config.json`` + ``model.safetensors`` (single or sharded) of this model or
    of a standard Qwen3 / Qwen3-MoE (``<save_dir>/model/``, an export);
(b) a ``.safetensors`` file with a ``config.json`` beside it;
(c) a resume checkpoint ``.pt`` (``<save_dir>/checkpoints/step_*.pt``), a sharded one (``step_*.dcp/`` of
    an ``--fsdp 1`` run: its meta.pt and shards) or a MiniMind state dict ``.pth``, read with
    ``torch.load(weights_only=True)`` so it never runs code stored in the file;
(d) a run directory ``<save_dir>``: its ``model/`` subdirectory, or, when a run crashed before
    writing one, its newest resume checkpoint (either kind).

Every problem (missing path, corrupt or truncated file, a pickle the safe loader refuses, a file
that is not a minisft model) raises ``ModelLoadError`` with a one-line message. The formats
themselves are read by ``trainer/weights/read.py``, the same code as ``--from_weight``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from model import MiniMindConfig, MiniMindForCausalLM
from model.rope import precompute_rope_tables

from dataset import DataError
from trainer.checkpoint.save_dir import SHARDED_SUFFIX, checkpoints_folder_problem, list_checkpoints
from trainer.errors import CheckpointError, ConfigError, ModelLoadError
from trainer.weights.read import (build_config, check_torch_file, folder_tokenizer, load_into, model_dir_of,
                                  read_weights, saved_tokenizer)
from trainer.weights.tokenizer import check_vocab_fits, resolve_tokenizer


# --------------------------------------------------------------------------- path kinds


def resolve_model_path(path: str | Path) -> tuple[str, Path]:
    """Classify ``path`` as ``("hf_dir" | "safetensors" | "checkpoint", concrete path)``."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: model path does not exist")
    if path.is_dir():
        if path.suffix == SHARDED_SUFFIX:  # a sharded resume checkpoint (--fsdp 1)
            return "checkpoint", path
        folder = Path(model_dir_of(str(path)))  # a run directory: its model/, whatever else lies at its top
        if (folder / "config.json").is_file():
            return "hf_dir", folder
        checkpoints = list_checkpoints(str(path))
        if checkpoints:
            return "checkpoint", Path(checkpoints[0])
        raise ModelLoadError(checkpoints_folder_problem(str(path)) or f"{path}: not a model directory (no "
                             "config.json), nor a run directory (no model/ or checkpoints/step_*.pt)")
    if path.suffix == ".safetensors":
        return "safetensors", path
    try:
        check_torch_file(str(path))  # a config.json, a text file: named, with what is accepted
    except CheckpointError as error:
        raise ModelLoadError(str(error)) from None
    return "checkpoint", path


# --------------------------------------------------------------------------- loading


def load_model_for_inference(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load a ``MiniMindForCausalLM`` in eval mode on ``device`` in ``dtype`` from any supported path kind."""
    _, concrete = resolve_model_path(path)
    try:
        weights = read_weights(str(concrete))
        model = model_from_weights(build_config(weights), weights, torch.device(device), dtype)
    except CheckpointError as error:
        raise ModelLoadError(str(error)) from None
    model.config.dtype = dtype
    return model.eval()


def empty_model(config: MiniMindConfig, device: torch.device,
                dtype: torch.dtype = torch.float32) -> MiniMindForCausalLM:
    """A model of `config` on `device`, its parameters in `dtype` and uninitialised (for weights that are
    loaded next), its RoPE tables computed (float32) and its tied head tied. Made on the meta device and
    allocated where it is wanted: no random initialisation that the weights would overwrite (Qwen3-0.6B:
    35 of the 38 s of a CPU build on two threads), and no float32 model on the host of one that is
    wanted in bfloat16, or on a GPU."""
    with torch.device("meta"):
        model = MiniMindForCausalLM(config).to(dtype)
    model.to_empty(device=device)
    # computed on the host and moved, as those of a model built on the host and moved: the same bits
    model.model.freqs_cos, model.model.freqs_sin = (table.to(device) for table in precompute_rope_tables(config))
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def model_from_weights(config: MiniMindConfig, weights, device: torch.device,
                       dtype: torch.dtype = torch.float32) -> MiniMindForCausalLM:
    """`empty_model` filled from `weights` (trainer/weights/read.py `load_into`: every tensor checked, each
    cast as it is copied); `weights.state` is emptied once copied."""
    model = empty_model(config, device, dtype)
    load_into(model, weights)
    weights.state.clear()
    return model


# --------------------------------------------------------------------------- tokenizer


def own_tokenizer_at(path: str | Path):
    """The tokenizer the model at ``path`` names (trainer/weights/tokenizer.py), found without reading
    its tensors: the files of an HF directory (or beside a safetensors file), a resume checkpoint's copy
    of its run's tokenizer (or, in a checkpoint without one, the directory and fingerprint it
    recorded); None for weights that name none."""
    kind, concrete = resolve_model_path(path)
    try:
        if kind != "checkpoint":
            return folder_tokenizer(str(concrete if kind == "hf_dir" else concrete.parent))
        return saved_tokenizer(str(concrete))
    except CheckpointError as error:
        raise ModelLoadError(str(error)) from None


def load_tokenizer_for_model(path: str | Path, tokenizer_path: str | Path | None = None, log=print,
                             vocab_size: int | None = None):
    """The tokenizer that goes with the model at ``path``: ``tokenizer_path`` if it is the model's own (by
    fingerprint), else the model's own (``own_tokenizer_at``), else the shipped one; one line if none fits,
    or if it does not fit the model's ``vocab_size`` as the trainer requires (``check_vocab_fits``)."""
    own = own_tokenizer_at(path)
    try:
        tokenizer, _, _ = resolve_tokenizer(own, str(tokenizer_path) if tokenizer_path else None, str(path), log)
        if vocab_size is not None:
            check_vocab_fits(tokenizer, vocab_size, own, str(path))
    except (DataError, ConfigError, CheckpointError) as error:
        raise ModelLoadError(str(error)) from None
    return tokenizer
