"""Model weights in every format `--from_weight`, the inference loader and the export read.

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
- a minisft resume checkpoint (`checkpoints/step_*.pt` or a sharded `step_*.dcp/`), read by the
  checkpoints' own reader (trainer/checkpoint/resume.py).

The formats written are in trainer/weights/write.py.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from dataclasses import dataclass

import torch

from model import MiniMindConfig
from model.configuration_minimind import rope_problem, yarn_factor
from model.rope import yarn_ramps_agree
from trainer.checkpoint import single_file
from trainer.checkpoint.files import safe_torch_load
from trainer.checkpoint.resume import load_resume_checkpoint
from trainer.checkpoint.save_dir import (
    CHECKPOINTS_DIR, METRICS_FILE, MODEL_DIR, SHARDED_SUFFIX, checkpoints_folder_problem,
)
from trainer.errors import CheckpointError, first_line
from trainer.weights.tokenizer import RECORD_FILE, OwnTokenizer, of_checkpoint, of_folder

WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile / DDP
QWEN3_TYPES = ("qwen3", "qwen3_moe")
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass
class Weights:
    """Tensors under our parameter names plus the architecture they describe."""

    state: dict
    config: dict  # MiniMindConfig keyword arguments
    source: str  # for the log: what was read
    tokenizer: OwnTokenizer | None = None  # the tokenizer they name (trainer/weights/tokenizer.py)


# --------------------------------------------------------------------------- reading


def minimind_pth_name(prefix: str, hidden_size: int, use_moe: bool) -> str:
    """MiniMind's file name for a model's weights, `{prefix}_{hidden_size}[_moe].pth`: the file its
    `--from_weight PREFIX` reads and its `--save_weight PREFIX` writes."""
    return f"{prefix}_{hidden_size}{'_moe' if use_moe else ''}.pth"


def resolve_minimind_name(value: str, save_dir: str, hidden_size: int, use_moe: bool) -> str:
    """MiniMind's `--from_weight pretrain` = `{save_dir}/pretrain_{hidden}[_moe].pth`; paths stay paths."""
    if os.path.exists(value) or not re.fullmatch(r"[\w.-]+", value) or value.endswith((".pth", ".pt")):
        return value
    candidate = os.path.join(save_dir, minimind_pth_name(value, hidden_size, use_moe))
    if os.path.isfile(candidate):
        return candidate
    raise CheckpointError(f"--from_weight {value}: neither a path nor MiniMind's {candidate} exists")


def read_weights(path: str) -> Weights:
    """Read any supported weights `path`; a problem is a one-line CheckpointError."""
    weights = _read_any(path)
    check_finite(weights)
    return weights


def _read_any(path: str) -> Weights:
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist")
    if os.path.isdir(path) and path.rstrip("/").endswith(SHARDED_SUFFIX):  # a sharded resume checkpoint (--fsdp 1)
        loaded = load_resume_checkpoint(path, required=("model_config", "model"))
        return Weights(clean_state_dict(loaded["model"]), _minimind_fields(loaded["model_config"]),
                       f"resume checkpoint {path}", of_checkpoint(loaded))
    if os.path.isdir(path):
        return _read_directory(model_dir_of(path))
    if path.endswith(".safetensors"):
        config_file = os.path.join(os.path.dirname(path), "config.json")
        state = _load_safetensors([path])
        if os.path.isfile(config_file):
            return _from_config_json(read_json(config_file), state, path, folder_tokenizer(os.path.dirname(path)))
        return Weights(state, config_from_shapes(state, path), f"safetensors file {path}")
    return _read_torch_file(path)


def check_finite(weights: Weights) -> None:
    """Weights holding a NaN or an infinity give a NaN loss at the first step and NaN logits: refused
    when read, naming the tensors, rather than blamed on the learning rate later."""
    bad = [key for key, value in weights.state.items()
           if value.is_floating_point() and not bool(torch.isfinite(value).all())]
    if bad:
        raise CheckpointError(f"{weights.source} holds non-finite values (NaN or inf) in {_tensors(bad)}: these "
                              "weights cannot be trained, evaluated or exported")


def _tensors(keys: list[str]) -> str:
    """'2 tensors (a, b)': at most three named."""
    return f"{len(keys)} tensor{'s' if len(keys) > 1 else ''} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"


def model_dir_of(folder: str) -> str:
    """The HF model directory that the directory `folder` stands for: a training run's (checkpoints/ or
    metrics.jsonl) inference weights `model/`, even where model files lie at its top; `folder/model` of
    a folder without config.json; else `folder`."""
    run_model = os.path.join(folder, MODEL_DIR)
    if os.path.isfile(os.path.join(run_model, "config.json")) and (
            any(os.path.exists(os.path.join(folder, name)) for name in (CHECKPOINTS_DIR, METRICS_FILE))
            or not os.path.isfile(os.path.join(folder, "config.json"))):
        return run_model
    return folder


def read_json(path: str) -> dict:
    """The JSON object of a model folder's file (config.json, the safetensors index)."""
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from error
    if not isinstance(value, dict):
        raise CheckpointError(f"cannot read {path}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_directory(folder: str) -> Weights:
    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        raise CheckpointError(checkpoints_folder_problem(folder)
                              or f"{folder}: no config.json (not an HF model directory)")
    saved = read_json(config_file)
    _check_model_type(saved, folder)
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    elif os.path.isfile(single):
        files = [single]
    else:
        raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    return _from_config_json(saved, _load_safetensors(files), folder, folder_tokenizer(folder))


def _load_safetensors(files: list[str]) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state = {}
    for name in files:
        if not os.path.isfile(name):
            raise CheckpointError(f"{name}: shard listed in the index does not exist")
        try:
            loaded = load_file(name)
        except (SafetensorError, OSError, ValueError) as error:
            raise CheckpointError(f"{name}: corrupt or truncated safetensors file ({first_line(error, 160)})") from error
        refuse_float8(loaded, name)
        state.update(loaded)
    return state


def refuse_float8(state: dict, path: str) -> None:
    """Float8 tensors are a quantized release whose scales this code does not apply (and no float8
    op it runs is defined): refused in one line where the file is read."""
    quantized = [key for key, value in state.items() if value.is_floating_point() and value.dtype.itemsize == 1]
    if quantized:
        raise CheckpointError(f"{path} holds float8 (quantized) weights in {_tensors(quantized)}: minisft reads "
                              "float32, bfloat16 or float16 weights; give the unquantized model")


TORCH_SUFFIXES = (".pt", ".pth", ".bin")
ACCEPTED_WEIGHTS = ("a MiniMind .pth or a state dict .pt, a resume checkpoint (checkpoints/step_*.pt or a sharded "
                    "step_*.dcp/), a .safetensors file, an HF model directory (config.json + model.safetensors) or a "
                    "training run's directory")
FILE_KINDS = {".json": "a JSON file", ".jsonl": "a JSON Lines file", ".txt": "a text file", ".md": "a text file",
              ".yaml": "a YAML file", ".yml": "a YAML file", ".jinja": "a template", ".py": "Python source"}


def check_torch_file(path: str) -> None:
    """Refuse, naming what is accepted, a file that cannot be a torch weights file: one of another kind
    (config.json, a text file) unless it really is a torch archive (then the safe load decides, and
    calls it malicious only if it holds pickled code)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in TORCH_SUFFIXES or zipfile.is_zipfile(path):
        return
    kind = FILE_KINDS.get(suffix, f"a {suffix} file" if suffix else "a file without a weights suffix")
    hint = ""
    if os.path.basename(path) == "config.json":
        hint = f"; for the model this config describes, give its folder {os.path.dirname(path) or '.'}"
    raise CheckpointError(f"{path} is {kind}, not model weights; weights are {ACCEPTED_WEIGHTS}{hint}")


def _read_torch_file(path: str) -> Weights:
    check_torch_file(path)
    loaded = safe_torch_load(path)  # memory-mapped: only the tensors used are read, into the shared page cache
    if single_file.is_resume_state(loaded):
        single_file.check_format(loaded, path)
        if not isinstance(loaded.get("model"), dict) or not isinstance(loaded.get("model_config"), dict):
            raise CheckpointError(f"resume checkpoint {path} is incomplete (missing model or model_config)")
        return Weights(clean_state_dict(loaded["model"]), _minimind_fields(loaded["model_config"]),
                       f"resume checkpoint {path}", of_checkpoint(loaded))
    if not isinstance(loaded, dict) or not loaded or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise CheckpointError(f"{path} is not a minisft resume checkpoint or a state dict (names to tensors)")
    refuse_float8(loaded, path)
    state = clean_state_dict(loaded)
    return Weights(state, config_from_shapes(state, path), f"MiniMind state dict {path}")


def folder_tokenizer(folder: str) -> OwnTokenizer | None:
    """The tokenizer a weights folder holds, with the fingerprint its RECORD_FILE gives (where it has one)."""
    record = os.path.join(folder, RECORD_FILE)
    return of_folder(folder, read_json(record) if os.path.isfile(record) else None)


def saved_tokenizer(path: str) -> OwnTokenizer | None:
    """The tokenizer a resume checkpoint names (None for a plain state dict), read without loading its
    tensors: a single file memory-mapped, a sharded `step_*.dcp/` from its meta.pt alone."""
    if os.path.isdir(path) and path.rstrip("/").endswith(SHARDED_SUFFIX):
        return of_checkpoint(load_resume_checkpoint(path, required=("args",)))
    check_torch_file(path)
    loaded = safe_torch_load(path)
    return of_checkpoint(loaded) if single_file.is_resume_state(loaded) else None


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


def _from_config_json(saved: dict, state: dict, source: str, tokenizer: OwnTokenizer | None) -> Weights:
    _check_model_type(saved, source)
    model_type = saved.get("model_type", "minimind")
    state = clean_state_dict(state)
    if model_type == "minimind":
        return Weights(state, _minimind_fields(saved), f"minisft model {source}", tokenizer)
    return Weights(state, config_from_qwen3(saved, source), f"{model_type} model {source}", tokenizer)


def _minimind_fields(saved: dict) -> dict:
    """MiniMindConfig arguments from a saved minimind config (config.json or a checkpoint's model_config)."""
    skip = ("architectures", "auto_map", "model_type", "dtype", "torch_dtype", "transformers_version")
    return {k: v for k, v in saved.items() if k not in skip}


def rope_key(saved: dict) -> str:
    """Where a Qwen3 config.json holds its RoPE settings, as transformers reads them: `rope_scaling` (4.x's
    key) where it is set, else `rope_parameters`."""
    return "rope_scaling" if saved.get("rope_scaling") else "rope_parameters"


def declared_yarn_problem(saved: dict, positions) -> str | None:
    """Why YaRN settings of a Qwen3 config.json that transformers could not read cannot work (`rope_problem`:
    its own check divides by original_max_position_embeddings), or None. `positions`: the config's
    max_position_embeddings, as transformers reads it (a null factor is computed from it)."""
    key = rope_key(saved)
    declared = saved.get(key)
    if (not isinstance(declared, dict) or declared.get("rope_type", declared.get("type")) != "yarn"
            or "original_max_position_embeddings" not in declared):  # transformers fills it in: not the cause
        return None
    return rope_problem(declared.get("rope_theta", saved.get("rope_theta", 10000.0)), declared, key, positions)


def config_from_qwen3(saved: dict, source: str) -> dict:
    """MiniMindConfig arguments for a Qwen3 / Qwen3-MoE config.json; what does not map is refused."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    moe = saved["model_type"] == "qwen3_moe"
    kind = Qwen3MoeConfig if moe else Qwen3Config
    try:
        hf = kind.from_dict(saved)
    except Exception as error:  # noqa: BLE001 - transformers validates in many ways
        positions = saved.get("max_position_embeddings", kind.max_position_embeddings)
        why = declared_yarn_problem(saved, positions) or f"invalid {saved['model_type']} config ({first_line(error)})"
        raise CheckpointError(f"{source}: {why}") from error

    def refuse(reason: str):
        raise CheckpointError(f"{source}: {reason}; this trainer's network cannot express it")

    if hf.hidden_act != "silu":
        refuse(f"hidden_act {hf.hidden_act!r} (only silu)")
    if getattr(hf, "attention_bias", False):
        refuse("attention_bias is true (q/k/v/o have biases)")
    if getattr(hf, "use_sliding_window", False):
        refuse("use_sliding_window is true")
    hf.standardize_rope_params()  # as its RoPE does before it computes: a top-level original context wins
    rope = dict(hf.rope_parameters or {})
    rope_type, theta = rope.get("rope_type", "default"), rope.get("rope_theta", 10000.0)
    yarn = None
    if rope_type == "yarn":
        if rope.get("mscale") or rope.get("mscale_all_dim") or rope.get("truncate") is False:
            refuse("YaRN with mscale / mscale_all_dim / truncate=false")
        yarn = {key: rope[key] for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                           "attention_factor") if key in rope}
        yarn["type"] = "yarn"
    elif rope_type != "default":
        refuse(f"rope_type {rope_type!r} (only default and yarn)")
    problem = rope_problem(theta, yarn, rope_key(saved), hf.max_position_embeddings)
    if problem:
        raise CheckpointError(f"{source}: {problem}")
    if yarn is not None:  # transformers' factor where it is null; other nulls are YaRN's defaults
        yarn = {key: value for key, value in {**yarn, "factor": yarn_factor(yarn, hf.max_position_embeddings)}.items()
                if value is not None}
    config = dict(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        # a Qwen3-MoE config may leave head_dim out: hidden_size / num_attention_heads then, as transformers has it
        head_dim=getattr(hf, "head_dim", None), intermediate_size=hf.intermediate_size,
        max_position_embeddings=hf.max_position_embeddings, rms_norm_eps=hf.rms_norm_eps, rope_theta=float(theta),
        tie_word_embeddings=bool(hf.tie_word_embeddings), initializer_range=hf.initializer_range, use_moe=moe,
    )
    if moe:
        if hf.mlp_only_layers or hf.decoder_sparse_step != 1:
            refuse("some layers are dense (mlp_only_layers / decoder_sparse_step): every layer here is MoE")
        config.update(num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                      moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                      router_aux_loss_coef=hf.router_aux_loss_coef)
    if yarn is not None:
        config["rope_scaling"] = yarn
    checked = checked_config(config, source)  # refused here, naming the folder as the refusals above do
    if yarn is not None and not yarn_ramps_agree(checked.head_dim, checked.rope_theta, yarn):
        yarn["ramp"] = "transformers"  # the ramp transformers computes for these settings
    return config


def misfit(expected: dict, state: dict, tied: bool, read_tie=None) -> str | None:
    """What keeps the tensors `state` from loading into a model whose state dict is `expected`, one part
    per kind, each counted and its first tensors named ("missing 9 tensors (a, b, c, ...); unexpected 1
    tensor (d)"), or None. A `tied` model needs no `lm_head.weight` (it is the embedding), and takes none
    that differs from the embedding: one tensor cannot hold both, so one of them would be lost. Where
    `state` holds shapes alone (meta tensors: a sharded checkpoint's index), `read_tie()` gives that
    verdict (`tie_difference` of the two read elsewhere), asked only when `state` holds both."""
    kinds = {
        "missing": [k for k in expected if k not in state and not (tied and k == LM_HEAD)],
        "unexpected": [k for k in state if k not in expected],
        "wrong shape": [k for k in state if k in expected and state[k].shape != expected[k].shape],
        "not float": [k for k in state if k in expected and not state[k].is_floating_point()],
    }
    problems = [f"{kind} {_tensors(keys)}" for kind, keys in kinds.items() if keys]
    if tied and LM_HEAD in state and EMBED in state and state[LM_HEAD].shape == state[EMBED].shape:
        problems.append(read_tie() if read_tie else tie_difference(state))
    return "; ".join(problem for problem in problems if problem) or None


def tie_difference(state: dict) -> str | None:
    """That `state`'s `lm_head.weight` differs from its embedding, which a tied model holds as one tensor."""
    if torch.equal(state[LM_HEAD], state[EMBED]):
        return None
    return f"{LM_HEAD} differs from {EMBED}, which is the same tensor in a model with tie_word_embeddings"


def with_tied_head(state: dict, tied: bool) -> dict:
    """`state` as a `tied` model's strict `load_state_dict` takes it: an `lm_head.weight` that it leaves
    out (`misfit` lets it) is its embedding."""
    return {**state, LM_HEAD: state[EMBED]} if tied and LM_HEAD not in state and EMBED in state else state


def load_into(model, weights: Weights) -> None:
    """Copy `weights.state` into `model` (fp32); any missing, extra or mis-shaped tensor is refused."""
    expected = model.state_dict()
    state = weights.state
    tied = model.config.tie_word_embeddings
    problems = misfit(expected, state, tied)
    if problems:
        raise CheckpointError(f"{weights.source} does not fit its model config: {problems}")
    with torch.no_grad():
        for key, value in state.items():
            if not (tied and key == LM_HEAD):
                expected[key].copy_(value)


def build_config(weights: Weights, **overrides) -> MiniMindConfig:
    """The complete MiniMindConfig of `weights` (`overrides` fill fields a `.pth` does not record)."""
    return checked_config({**overrides, **weights.config}, weights.source)


def checked_config(fields: dict, source: str) -> MiniMindConfig:
    """MiniMindConfig(**fields) of the weights `source`; one it refuses is a CheckpointError naming them."""
    try:
        return MiniMindConfig(**fields)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{source}: invalid model config ({first_line(error, 160)})") from error
