"""Load a trained MiniMind model (and its tokenizer) for inference, from any place training writes one.

Accepted ``path`` kinds:

(a) an HF directory: ``config.json`` + ``model.safetensors`` (``<save_dir>/model/``, an export);
(b) a ``.safetensors`` file with a ``config.json`` beside it;
(c) a resume checkpoint ``.pt`` (``<save_dir>/checkpoints/step_*.pt``), read with
    ``torch.load(weights_only=True)`` so it never runs code stored in the file;
(d) a run directory ``<save_dir>``: its ``model/`` subdirectory, or, when a run crashed before
    writing one, its newest resume checkpoint.

Every problem (missing path, corrupt or truncated file, a pickle the safe loader refuses, a file
that is not a minisft model) raises ``ModelLoadError`` with a one-line message.
"""

from __future__ import annotations

from pathlib import Path

import torch

from model import MiniMindConfig, MiniMindForCausalLM

from .checkpoint import CheckpointError, list_checkpoints, load_resume_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Prefixes added by torch.compile / DistributedDataParallel wrappers.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


class ModelLoadError(ValueError):
    """A model path that cannot be loaded; the message is one line naming the path and the problem."""


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:160]}" if lines else type(error).__name__


# --------------------------------------------------------------------------- path kinds


def resolve_model_path(path: str | Path) -> tuple[str, Path]:
    """Classify ``path`` as ``("hf_dir" | "safetensors" | "checkpoint", concrete path)``."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: model path does not exist")
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf_dir", path
        if (path / "model" / "config.json").is_file():
            return "hf_dir", path / "model"
        checkpoints = list_checkpoints(str(path))
        if checkpoints:
            return "checkpoint", Path(checkpoints[0])
        raise ModelLoadError(
            f"{path}: not a model directory (no config.json), nor a run directory (no model/ or checkpoints/step_*.pt)"
        )
    if path.suffix == ".safetensors":
        return "safetensors", path
    if path.suffix in (".pt", ".pth", ".bin"):
        return "checkpoint", path
    raise ModelLoadError(f"{path}: unknown model file type (expected a directory, .safetensors or .pt)")


# --------------------------------------------------------------------------- checkpoints


def read_checkpoint(path: str | Path) -> dict:
    """Safely read a minisft resume checkpoint (``weights_only=True``) and check its format."""
    try:
        return load_resume_checkpoint(str(path), required=("model_config", "model"))
    except CheckpointError as error:
        raise ModelLoadError(str(error)) from None


def _clean_state_dict(state: dict, config: MiniMindConfig) -> dict:
    """Strip compile/DDP prefixes and restore a tied ``lm_head.weight`` that was saved only once."""
    cleaned = {}
    for key, value in state.items():
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
        cleaned[key] = value
    if config.tie_word_embeddings and "lm_head.weight" not in cleaned and "model.embed_tokens.weight" in cleaned:
        cleaned["lm_head.weight"] = cleaned["model.embed_tokens.weight"]
    return cleaned


def _build_model(config: MiniMindConfig, state: dict, source: Path) -> MiniMindForCausalLM:
    if any(not isinstance(value, torch.Tensor) for value in state.values()):
        raise ModelLoadError(f"{source}: the weights contain non-tensor entries")
    model = MiniMindForCausalLM(config)
    try:
        model.load_state_dict(_clean_state_dict(state, config), strict=True)
    except RuntimeError as error:
        raise ModelLoadError(f"{source}: weights do not match the model config ({_first_line(error)})") from None
    return model


def _config_from_dict(values: dict, source: Path) -> MiniMindConfig:
    try:
        return MiniMindConfig(**values)
    except (TypeError, ValueError) as error:
        raise ModelLoadError(f"{source}: invalid model config ({_first_line(error)})") from None


# --------------------------------------------------------------------------- loaders per kind


def _load_hf_dir(directory: Path, dtype: torch.dtype) -> MiniMindForCausalLM:
    from transformers.utils import logging as hf_logging

    show_progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the scripts' output
    try:
        model, info = MiniMindForCausalLM.from_pretrained(str(directory), dtype=dtype, output_loading_info=True)
    except Exception as error:  # noqa: BLE001 - a damaged directory fails in many ways
        raise ModelLoadError(f"{directory}: cannot load model directory ({_first_line(error)})") from None
    finally:
        if show_progress:
            hf_logging.enable_progress_bar()
    names = ("missing_keys", "unexpected_keys", "mismatched_keys")
    problems = {name: info.get(name) for name in names if info.get(name)}
    if problems:
        name, keys = next(iter(problems.items()))
        raise ModelLoadError(f"{directory}: weights do not match config.json ({name}: {sorted(keys)[:3]})")
    return model


def _load_safetensors_file(path: Path) -> MiniMindForCausalLM:
    from safetensors.torch import load_file

    config_path = path.parent / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path}: no config.json beside the safetensors file")
    try:
        config = MiniMindConfig.from_json_file(str(config_path))
    except Exception as error:  # noqa: BLE001 - bad JSON, bad values
        raise ModelLoadError(f"{config_path}: unreadable model config ({_first_line(error)})") from None
    try:
        state = load_file(str(path))
    except Exception as error:  # noqa: BLE001 - SafetensorError, OSError, ...
        raise ModelLoadError(f"{path}: corrupt or truncated safetensors file ({_first_line(error)})") from None
    return _build_model(config, state, path)


def _load_checkpoint(path: Path) -> MiniMindForCausalLM:
    state = read_checkpoint(path)
    config = _config_from_dict(dict(state["model_config"]), path)
    return _build_model(config, state["model"], path)


def load_model_for_inference(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load a ``MiniMindForCausalLM`` in eval mode on ``device`` in ``dtype`` from any supported path kind."""
    kind, concrete = resolve_model_path(path)
    if kind == "hf_dir":
        model = _load_hf_dir(concrete, dtype)
    elif kind == "safetensors":
        model = _load_safetensors_file(concrete)
    else:
        model = _load_checkpoint(concrete)
    model.config.dtype = dtype
    return model.to(device=device, dtype=dtype).eval()


# --------------------------------------------------------------------------- tokenizer


def load_tokenizer_for_model(path: str | Path, tokenizer_path: str | Path | None = None):
    """The tokenizer that goes with the model at ``path``.

    Order: an explicit ``tokenizer_path``; tokenizer files inside the HF directory (or beside the
    safetensors file); the checkpoint's ``args["tokenizer_path"]``; the shipped default.
    """
    from dataset import DataError, load_tokenizer

    if tokenizer_path is None:
        kind, concrete = resolve_model_path(path)
        folder = concrete if kind == "hf_dir" else concrete.parent
        if kind != "checkpoint" and any((folder / name).is_file() for name in TOKENIZER_FILES):
            tokenizer_path = folder
        elif kind == "checkpoint":
            args = read_checkpoint(concrete).get("args")
            if isinstance(args, dict) and args.get("tokenizer_path"):
                tokenizer_path = args["tokenizer_path"]
    try:
        return load_tokenizer(tokenizer_path)
    except DataError as error:
        raise ModelLoadError(str(error)) from None
