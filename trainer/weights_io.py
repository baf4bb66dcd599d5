"""Weights in and out: every format `--from_weight`, the inference loader and the export speak.

Our network is MiniMind's and transformers' Qwen3 at once: the three share parameter names and
shapes (MoE: Qwen3-MoE's on-disk per-expert names), so converting is a matter of the config, a
tied `lm_head.weight` that may be absent, and the dtype. Formats read (`read_weights`):

- a MiniMind state dict `.pth` / `.pt` (any float dtype, `torch.load(weights_only=True)`): the
  shapes give vocab, width, layers, heads, kv heads, head_dim, MLP/MoE sizes and tying; the
  rest (rms eps, experts per token, aux coefficient, rope) comes from the flags or MiniMind's
  defaults;
- an HF directory of this model (`model_type` minimind), or a native Qwen3 / Qwen3-MoE
  directory (`model_type` qwen3 / qwen3_moe), single or sharded safetensors;
- a `.safetensors` file (config.json beside it, else shapes as for a `.pth`);
- a minisft resume checkpoint (`checkpoints/step_*.pt`).

Formats written: `write_qwen3_dir` (a standard Qwen3 / Qwen3-MoE directory that transformers
loads without remote code), `write_remote_code_dir` (model_type minimind + our code),
`write_minimind_pth` (MiniMind's `{prefix}_{hidden}[_moe].pth`, fp16, lm_head included).
`qwen3_unsupported` / `minimind_unsupported` say why a config cannot be written in a format.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass

import torch

from model import MiniMindConfig
from trainer.checkpoint import FORMAT as RESUME_FORMAT
from trainer.checkpoint import FORMAT_VERSION as RESUME_FORMAT_VERSION
from trainer.checkpoint import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile / DDP
QWEN3_TYPES = ("qwen3", "qwen3_moe")
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass
class Weights:
    """Tensors under our parameter names plus the architecture they describe."""

    state: dict
    config: dict  # MiniMindConfig keyword arguments
    source: str  # for the log: what was read
    tokenizer_dir: str | None = None  # a tokenizer saved with the weights


# --------------------------------------------------------------------------- reading


def resolve_minimind_name(value: str, save_dir: str, hidden_size: int, use_moe: bool) -> str:
    """MiniMind's `--from_weight pretrain` = `{save_dir}/pretrain_{hidden}[_moe].pth`; paths stay paths."""
    if os.path.exists(value) or not re.fullmatch(r"[\w.-]+", value) or value.endswith((".pth", ".pt")):
        return value
    candidate = os.path.join(save_dir, f"{value}_{hidden_size}{'_moe' if use_moe else ''}.pth")
    if os.path.isfile(candidate):
        return candidate
    raise CheckpointError(f"--from_weight {value}: neither a path nor MiniMind's {candidate} exists")


def read_weights(path: str) -> Weights:
    """Read any supported weights `path`; a problem is a one-line CheckpointError."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist")
    if os.path.isdir(path) and path.rstrip("/").endswith(".dcp"):  # a sharded resume checkpoint (--fsdp 1)
        from trainer.checkpoint import load_resume_checkpoint

        loaded = load_resume_checkpoint(path, required=("model_config", "model"))
        return Weights(clean_state_dict(loaded["model"]), _minimind_fields(loaded["model_config"]),
                       f"resume checkpoint {path}")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "model", "config.json")):
            path = os.path.join(path, "model")  # a run directory: its inference weights
        return _read_directory(path)
    if path.endswith(".safetensors"):
        config_file = os.path.join(os.path.dirname(path), "config.json")
        state = _load_safetensors([path])
        if os.path.isfile(config_file):
            return _from_config_json(_read_json(config_file), state, path, _tokenizer_dir(os.path.dirname(path)))
        return Weights(state, config_from_shapes(state, path), f"safetensors file {path}")
    return _read_torch_file(path)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from error


def _tokenizer_dir(folder: str) -> str | None:
    return folder if any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES) else None


def _read_directory(folder: str) -> Weights:
    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        raise CheckpointError(f"{folder}: no config.json (not an HF model directory)")
    saved = _read_json(config_file)
    _check_model_type(saved, folder)
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    elif os.path.isfile(single):
        files = [single]
    else:
        raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    return _from_config_json(saved, _load_safetensors(files), folder, _tokenizer_dir(folder))


def _load_safetensors(files: list[str]) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state = {}
    for name in files:
        if not os.path.isfile(name):
            raise CheckpointError(f"{name}: shard listed in the index does not exist")
        try:
            state.update(load_file(name))
        except (SafetensorError, OSError, ValueError) as error:
            raise CheckpointError(f"{name}: corrupt or truncated safetensors file ({_first_line(error)})") from error
    return state


def _load_torch_file(path: str, mmap: bool = False):
    """`torch.load(weights_only=True)` with one-line errors."""
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"{path} is empty")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" in str(error):
            raise CheckpointError(f"refused to load {path}: it holds Python objects that a safe (weights_only) load "
                                  "does not allow; it is not a checkpoint and may be malicious") from error
        raise CheckpointError(f"{path} is corrupt or truncated ({_first_line(error)})") from error
    except Exception as error:  # noqa: BLE001 - torch raises many types for a damaged file
        raise CheckpointError(f"{path} is corrupt or truncated ({_first_line(error)})") from error


def _read_torch_file(path: str) -> Weights:
    loaded = _load_torch_file(path)
    if isinstance(loaded, dict) and loaded.get("format") == RESUME_FORMAT:
        version = loaded.get("format_version")
        if not isinstance(version, int) or version > RESUME_FORMAT_VERSION:
            raise CheckpointError(f"{path} was written by a newer minisft (format version {version}): upgrade minisft")
        if not isinstance(loaded.get("model"), dict) or not isinstance(loaded.get("model_config"), dict):
            raise CheckpointError(f"resume checkpoint {path} is incomplete (missing model or model_config)")
        return Weights(clean_state_dict(loaded["model"]), _minimind_fields(loaded["model_config"]),
                       f"resume checkpoint {path}")
    if not isinstance(loaded, dict) or not loaded or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise CheckpointError(f"{path} is not a minisft resume checkpoint or a state dict (names to tensors)")
    state = clean_state_dict(loaded)
    return Weights(state, config_from_shapes(state, path), f"MiniMind state dict {path}")


def saved_run_args(path: str) -> dict | None:
    """The flags stored in a resume checkpoint (None for a plain state dict), read without loading its tensors."""
    loaded = _load_torch_file(path, mmap=True)
    if isinstance(loaded, dict) and loaded.get("format") == RESUME_FORMAT and isinstance(loaded.get("args"), dict):
        return loaded["args"]
    return None


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[0][:160] if lines else type(error).__name__


def clean_state_dict(state: dict) -> dict:
    """Strip compile/DDP prefixes; split fused Qwen3-MoE expert tensors into per-expert ones."""
    cleaned = {}
    for key, value in state.items():
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
        cleaned[key] = value
    for key in [k for k in cleaned if k.endswith(".mlp.experts.gate_up_proj")]:
        # transformers' in-memory layout: gate_up_proj [E, 2I, H] (gate first), down_proj [E, H, I]
        prefix = key[: -len("gate_up_proj")]
        gate_up, down = cleaned.pop(key), cleaned.pop(prefix + "down_proj")
        gate, up = gate_up.chunk(2, dim=1)
        for expert in range(gate_up.shape[0]):
            cleaned[f"{prefix}{expert}.gate_proj.weight"] = gate[expert]
            cleaned[f"{prefix}{expert}.up_proj.weight"] = up[expert]
            cleaned[f"{prefix}{expert}.down_proj.weight"] = down[expert]
    return cleaned


def config_from_shapes(state: dict, source: str) -> dict:
    """The architecture a MiniMind-layout state dict implies. Not recorded in the shapes, so left to the
    flags or MiniMind's defaults: rms_norm_eps, rope_theta, num_experts_per_tok, the aux coefficient,
    norm_topk_prob, max_position_embeddings."""
    needed = (EMBED, "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.0.self_attn.q_norm.weight")
    missing = [name for name in needed if name not in state]
    if missing:
        raise CheckpointError(f"{source} is not a minisft resume checkpoint or a MiniMind/Qwen3 state dict "
                              f"(no {missing[0]})")
    vocab, hidden = state[EMBED].shape
    head_dim = state["model.layers.0.self_attn.q_norm.weight"].shape[0]
    layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
    config = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, head_dim=head_dim,
        num_attention_heads=state["model.layers.0.self_attn.q_proj.weight"].shape[0] // head_dim,
        num_key_value_heads=state["model.layers.0.self_attn.k_proj.weight"].shape[0] // head_dim,
        tie_word_embeddings=LM_HEAD not in state or torch.equal(state[LM_HEAD], state[EMBED]),
    )
    if "model.layers.0.mlp.gate.weight" in state:
        config.update(use_moe=True, num_experts=state["model.layers.0.mlp.gate.weight"].shape[0],
                      moe_intermediate_size=state["model.layers.0.mlp.experts.0.gate_proj.weight"].shape[0])
    elif "model.layers.0.mlp.gate_proj.weight" in state:
        config.update(use_moe=False, intermediate_size=state["model.layers.0.mlp.gate_proj.weight"].shape[0])
    else:
        raise CheckpointError(f"{source} is not a MiniMind/Qwen3 state dict (no MLP weights in layer 0)")
    return config


def _check_model_type(saved: dict, source: str) -> None:
    model_type = saved.get("model_type", "minimind")
    if model_type != "minimind" and model_type not in QWEN3_TYPES:
        raise CheckpointError(f"{source}: model_type {model_type!r} is not supported (minimind, qwen3, qwen3_moe)")


def _from_config_json(saved: dict, state: dict, source: str, tokenizer_dir: str | None) -> Weights:
    _check_model_type(saved, source)
    model_type = saved.get("model_type", "minimind")
    state = clean_state_dict(state)
    if model_type == "minimind":
        return Weights(state, _minimind_fields(saved), f"minisft model {source}", tokenizer_dir)
    return Weights(state, config_from_qwen3(saved, source), f"{model_type} model {source}", tokenizer_dir)


def _minimind_fields(saved: dict) -> dict:
    """MiniMindConfig arguments from a saved minimind config (config.json or a checkpoint's model_config)."""
    skip = ("architectures", "auto_map", "model_type", "dtype", "torch_dtype", "transformers_version")
    return {k: v for k, v in saved.items() if k not in skip}


def config_from_qwen3(saved: dict, source: str) -> dict:
    """MiniMindConfig arguments for a Qwen3 / Qwen3-MoE config.json; what does not map is refused."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    moe = saved["model_type"] == "qwen3_moe"
    try:
        hf = (Qwen3MoeConfig if moe else Qwen3Config).from_dict(saved)
    except Exception as error:  # noqa: BLE001 - transformers validates in many ways
        raise CheckpointError(f"{source}: invalid {saved['model_type']} config ({_first_line(error)})") from error

    def refuse(reason: str):
        raise CheckpointError(f"{source}: {reason}; this trainer's network cannot express it")

    if hf.hidden_act != "silu":
        refuse(f"hidden_act {hf.hidden_act!r} (only silu)")
    if getattr(hf, "attention_bias", False):
        refuse("attention_bias is true (q/k/v/o have biases)")
    if getattr(hf, "use_sliding_window", False):
        refuse("use_sliding_window is true")
    rope = dict(hf.rope_parameters or {})
    rope_type = rope.get("rope_type", "default")
    config = dict(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim or hf.hidden_size // hf.num_attention_heads, intermediate_size=hf.intermediate_size,
        max_position_embeddings=hf.max_position_embeddings, rms_norm_eps=hf.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", 10000.0)), tie_word_embeddings=bool(hf.tie_word_embeddings),
        initializer_range=hf.initializer_range, use_moe=moe,
    )
    if rope_type == "yarn":
        if rope.get("mscale") or rope.get("mscale_all_dim") or rope.get("truncate") is False or not rope.get("factor"):
            refuse("YaRN with mscale / mscale_all_dim / truncate=false / no factor")
        config["rope_scaling"] = {key: rope[key] for key in ("factor", "original_max_position_embeddings", "beta_fast",
                                                             "beta_slow", "attention_factor") if rope.get(key) is not None}
        config["rope_scaling"]["type"] = "yarn"
    elif rope_type != "default":
        refuse(f"rope_type {rope_type!r} (only default and yarn)")
    if moe:
        if hf.mlp_only_layers or hf.decoder_sparse_step != 1:
            refuse("some layers are dense (mlp_only_layers / decoder_sparse_step): every layer here is MoE")
        config.update(num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                      moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                      router_aux_loss_coef=hf.router_aux_loss_coef)
    return config


def load_into(model, weights: Weights) -> None:
    """Copy `weights.state` into `model` (fp32); any missing, extra or mis-shaped tensor is refused."""
    expected = model.state_dict()
    state = weights.state
    tied = model.config.tie_word_embeddings
    missing = [k for k in expected if k not in state and not (tied and k == LM_HEAD)]
    unexpected = [k for k in state if k not in expected]
    wrong_shape = [k for k in state if k in expected and state[k].shape != expected[k].shape]
    not_float = [k for k in state if k in expected and not state[k].is_floating_point()]
    if missing or unexpected or wrong_shape or not_float:
        details = (f" missing {missing[:3]}" if missing else "") + (f" unexpected {unexpected[:3]}" if unexpected else "")
        details += (f" wrong shape {wrong_shape[:3]}" if wrong_shape else "") + (f" not float {not_float[:3]}" if not_float else "")
        raise CheckpointError(f"{weights.source} does not fit its model config:{details}")
    if tied and LM_HEAD in state and not torch.equal(state[LM_HEAD], state[EMBED]):
        raise CheckpointError(f"{weights.source}: tie_word_embeddings is set but lm_head differs from the embedding")
    with torch.no_grad():
        for key, value in state.items():
            if not (tied and key == LM_HEAD):
                expected[key].copy_(value)


def build_config(weights: Weights, **overrides) -> MiniMindConfig:
    """The complete MiniMindConfig of `weights` (`overrides` fill fields a `.pth` does not record)."""
    try:
        return MiniMindConfig(**{**overrides, **weights.config})
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{weights.source}: invalid model config ({_first_line(error)})") from error


# --------------------------------------------------------------------------- writing


def qwen3_unsupported(config: MiniMindConfig) -> str | None:
    """Why `config` has no standard Qwen3 / Qwen3-MoE form (None: it has one)."""
    yarn = config.rope_yarn or {}
    unknown = sorted(set(yarn) - {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast",
                                  "beta_slow", "attention_factor"})
    if unknown:
        return f"rope_scaling has settings transformers' YaRN does not read: {unknown}"
    return None


def qwen3_config(config: MiniMindConfig, dtype: torch.dtype):
    """transformers' Qwen3Config / Qwen3MoeConfig with the same mathematics as `config`."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    rope = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if config.rope_yarn:
        rope = {"rope_type": "yarn", "rope_theta": float(config.rope_theta),
                **{k: v for k, v in config.rope_yarn.items() if k not in ("type", "rope_type")}}
        rope.setdefault("attention_factor", None)
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, intermediate_size=config.intermediate_size, hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_parameters={k: v for k, v in rope.items() if v is not None}, attention_bias=False,
        tie_word_embeddings=config.tie_word_embeddings, initializer_range=config.initializer_range,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        dtype=dtype,
    )
    if config.use_moe:
        hf = Qwen3MoeConfig(**common, num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                            moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                            router_aux_loss_coef=config.router_aux_loss_coef, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        hf = Qwen3Config(**common)
    hf.architectures = ["Qwen3MoeForCausalLM" if config.use_moe else "Qwen3ForCausalLM"]
    return hf


def _inference_state(model, dtype: torch.dtype) -> dict:
    tied = model.config.tie_word_embeddings
    return {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if not (tied and k == LM_HEAD)}


def write_inference_dir(model, folder: str, dtype: torch.dtype) -> str:
    """The trainer's `<save_dir>/model/`: the standard Qwen3 form where the config has one (so no
    tool needs remote code for it), else the remote-code form. Returns the format written."""
    if qwen3_unsupported(model.config) is None:
        write_qwen3_dir(model, folder, dtype)
        return "qwen3"
    write_remote_code_dir(model, folder, dtype)
    return "remote-code"


def write_qwen3_dir(model, folder: str, dtype: torch.dtype) -> None:
    """config.json (model_type qwen3 / qwen3_moe), generation_config.json, model.safetensors."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    reason = qwen3_unsupported(model.config)
    if reason:
        raise CheckpointError(f"this model has no standard Qwen3 form: {reason}")
    os.makedirs(folder, exist_ok=True)
    qwen3_config(model.config, dtype).save_pretrained(folder)
    GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
                     pad_token_id=model.config.pad_token_id).save_pretrained(folder)
    save_file(_inference_state(model, dtype), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def write_remote_code_dir(model, folder: str, dtype: torch.dtype) -> None:
    """model_type minimind with our code and an `auto_map` (needs trust_remote_code)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder, state_dict=_inference_state(model, dtype))
    finally:
        hf_logging.enable_progress_bar()
    # save_pretrained records the live model's dtype; record the saved weights' dtype.
    config_file = os.path.join(folder, "config.json")
    config = _read_json(config_file)
    config["dtype"] = str(dtype).removeprefix("torch.")
    with open(config_file, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)


# MiniMind's own config (model/model_minimind.py): YaRN only as this fixed `inference_rope_scaling` dict.
MINIMIND_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 2048,
                 "attention_factor": 1.0, "type": "yarn"}


def minimind_unsupported(config: MiniMindConfig) -> str | None:
    """Why MiniMind's model cannot hold `config` (None: it can)."""
    if not config.tie_word_embeddings:
        return "the LM head is not tied to the embedding (MiniMind always ties them)"
    if config.rope_yarn and config.rope_yarn != MINIMIND_YARN:
        return "its YaRN rope_scaling differs from MiniMind's only one (inference_rope_scaling)"
    return None


def minimind_pth_name(config: MiniMindConfig, prefix: str) -> str:
    return f"{prefix}_{config.hidden_size}{'_moe' if config.use_moe else ''}.pth"


def minimind_settings(config: MiniMindConfig) -> dict:
    """Keyword arguments MiniMind's MiniMindConfig needs besides hidden_size, num_hidden_layers, use_moe.

    Our defaults are MiniMind's, so these are exactly the fields that differ from our defaults."""
    reference = MiniMindConfig(hidden_size=config.hidden_size, use_moe=config.use_moe)
    fields = ["vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "rms_norm_eps", "rope_theta", "max_position_embeddings"]
    if config.use_moe:
        fields += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef"]
    settings = {k: getattr(config, k) for k in fields if getattr(config, k) != getattr(reference, k)}
    if config.rope_yarn:
        settings["inference_rope_scaling"] = True
    return settings


def save_minimind_copy(model, save_dir: str, prefix: str) -> str:
    """The trainer's `--save_weight PREFIX`: MiniMind's own `{save_dir}/{prefix}_{hidden}[_moe].pth`."""
    path = os.path.join(save_dir, minimind_pth_name(model.config, prefix))
    write_minimind_pth(model, path)
    return path


def write_minimind_pth(model, path: str) -> None:
    """MiniMind's `torch.save({k: v.half() for k in model.state_dict()})`, lm_head.weight included."""
    from trainer.checkpoint import atomic_torch_save

    reason = minimind_unsupported(model.config)
    if reason:
        raise CheckpointError(f"this model has no MiniMind .pth form: {reason}")
    state = model.state_dict()
    atomic_torch_save({k: v.detach().to(torch.float16).clone() for k, v in state.items()}, path)
