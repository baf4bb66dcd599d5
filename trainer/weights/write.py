"""Model weights written: the inference directory a run publishes (`model/`, `best/`), the exports,
MiniMind's `.pth`.

- `publish_inference_weights`: `<save_dir>/model/` (or `best/`) replaced atomically: written under a
  temporary name, fsynced, swapped in; a failed write leaves the previous directory in place.
- `write_qwen3_dir`: a standard Qwen3 / Qwen3-MoE directory that transformers loads without
  remote code; `write_remote_code_dir`: model_type minimind + our code;
  `write_minimind_pth`: MiniMind's `{prefix}_{hidden}[_moe].pth` (fp16, lm_head included).
- `qwen3_unsupported` / `minimind_unsupported` say why a config cannot be written in a format.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from model import MiniMindConfig
from model.rope import yarn_ramps_agree
from trainer.checkpoint.files import atomic_torch_save, fsync_dir, settle_files, write_failure
from trainer.checkpoint.save_dir import MODEL_DIR
from trainer.errors import CheckpointError
from trainer.weights.read import LM_HEAD, minimind_pth_name, read_json
from trainer.weights.tokenizer import RECORD_FILE, folder_record


def publish_inference_weights(model, tokenizer, save_dir: str, dtype: torch.dtype, name: str = MODEL_DIR,
                           extra_files: dict[str, str] | None = None) -> str:
    """Write `<save_dir>/<name>/` (an HF directory, plus `extra_files`: file name -> text) atomically;
    return its path."""
    final = os.path.join(save_dir, name)
    tmp, old = os.path.join(save_dir, f".{name}.tmp.{os.getpid()}"), os.path.join(save_dir, f".{name}.old")
    if os.path.isdir(old) and not os.path.exists(final):  # a crash between the two renames below
        os.replace(old, final)
    for entry in os.listdir(save_dir):  # what killed saves left (the save_dir lock makes this safe)
        if entry.startswith(f".{name}.tmp"):
            shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)
    try:
        write_model_dir(model, tokenizer, tmp, dtype, extra_files=extra_files)
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(save_dir)
    except BaseException as error:  # nothing left behind, whatever stopped the write
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(final) and os.path.exists(old):
            try:
                os.replace(old, final)
            except OSError:
                pass
        reason = write_failure(error)  # a full disk: OSError, SafetensorError, or tokenizers' bare Exception
        if reason is None:
            raise
        raise CheckpointError(f"could not write inference weights to {final}: {reason}") from error
    return final




def write_model_dir(model, tokenizer, folder: str, dtype: torch.dtype, fmt: str = "auto",
                    extra_files: dict[str, str] | None = None) -> str:
    """`folder` as an HF model directory: the weights (`fmt` "qwen3", "remote-code", or "auto": the
    Qwen3 form where the config has one), the tokenizer with its record (RECORD_FILE: tokenizer files
    copied over the folder later are refused, trainer/weights/tokenizer.py) and `extra_files` (file
    name -> text); every file with the mode a plainly created file gets (the umask's) and fsynced.
    Returns the format."""
    if fmt == "auto":
        fmt = write_inference_dir(model, folder, dtype)
    else:
        (write_qwen3_dir if fmt == "qwen3" else write_remote_code_dir)(model, folder, dtype)
    write_tokenizer(tokenizer, folder)
    for file_name, text in {RECORD_FILE: folder_record(tokenizer), **(extra_files or {})}.items():
        with open(os.path.join(folder, file_name), "w", encoding="utf-8") as handle:
            handle.write(text)
    settle_files(folder)
    return fmt


def write_tokenizer(tokenizer, folder: str) -> None:
    """The tokenizer files, read the same by transformers 4.4x-4.5x and 5.x: transformers 5 names
    its class "TokenizersBackend", which 4.x does not have ("Tokenizer class TokenizersBackend does
    not exist"); both load "PreTrainedTokenizerFast" from tokenizer.json alike. The chat template is
    also kept in tokenizer_config.json, where transformers versions without chat_template.jinja look for it."""
    tokenizer.save_pretrained(folder)
    config_file = os.path.join(folder, "tokenizer_config.json")
    config = read_json(config_file)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # where transformers 5 loaded it from, not a setting
        config.pop(key, None)
    if isinstance(tokenizer.chat_template, str):
        config["chat_template"] = tokenizer.chat_template
    with open(config_file, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, ensure_ascii=False)
        handle.write("\n")


def qwen3_unsupported(config: MiniMindConfig) -> str | None:
    """Why `config` has no standard Qwen3 / Qwen3-MoE form (None: it has one)."""
    yarn = config.rope_yarn or {}
    unknown = sorted(set(yarn) - {"type", "rope_type", "ramp", "factor", "original_max_position_embeddings",
                                  "beta_fast", "beta_slow", "attention_factor"})
    if unknown:
        return f"rope_scaling has settings transformers' YaRN does not read: {unknown}"
    if yarn and yarn.get("ramp") != "transformers" and not yarn_ramps_agree(config.head_dim, config.rope_theta, yarn):
        return ("its YaRN ramp is MiniMind's (correction range clamped at head_dim/2 - 1), which for these settings "
                "differs from transformers' (clamped at head_dim - 1)")
    return None


def qwen3_config(config: MiniMindConfig, dtype: torch.dtype):
    """transformers' Qwen3Config / Qwen3MoeConfig with the same mathematics as `config`."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    rope = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if config.rope_yarn:
        rope = {"rope_type": "yarn", "rope_theta": float(config.rope_theta),
                **{k: v for k, v in config.rope_yarn.items() if k not in ("type", "rope_type", "ramp")}}
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
    """The weights to write, on the host in `dtype`: each cast and copied before the next, so a
    model on a GPU needs device memory for one cast weight at a time."""
    tied = model.config.tie_word_embeddings
    return {k: v.detach().to(dtype).cpu().contiguous() for k, v in model.state_dict().items()
            if not (tied and k == LM_HEAD)}


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
    _add_transformers4_fields(os.path.join(folder, "config.json"))
    GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
                     pad_token_id=model.config.pad_token_id).save_pretrained(folder)
    save_file(_inference_state(model, dtype), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _add_transformers4_fields(config_file: str) -> None:
    """transformers 5 writes RoPE as `rope_parameters` only; 4.x reads top-level `rope_theta` and
    `rope_scaling` and, finding neither, silently uses theta 10,000 (ours: 1,000,000 by default).
    Both are added with the same values. transformers 5 reads `rope_scaling` first when it is set, so
    it holds exactly `rope_parameters` less `rope_theta` (which 4.x's YaRN check would call unknown),
    and is null without YaRN, as 4.x writes it. `torch_dtype` is 4.x's name for `dtype`, and
    `num_experts` its name for `num_local_experts`."""
    config = read_json(config_file)
    rope = dict(config["rope_parameters"])
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    config["torch_dtype"] = config.get("dtype")
    if "num_local_experts" in config:  # transformers 5's name; Qwen3MoeConfig of 4.x reads num_experts (else 128)
        config["num_experts"] = config["num_local_experts"]
    with open(config_file, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
        handle.write("\n")


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
    config = read_json(config_file)
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


def pth_prefix_problem(prefix: str, folder_flag: str) -> str | None:
    """Why `--save_weight PREFIX` cannot name a MiniMind .pth inside the folder of `folder_flag`
    (empty, or a path: the file would land elsewhere), or None."""
    if prefix and os.path.basename(prefix) == prefix and prefix not in (".", ".."):
        return None
    return f"--save_weight {prefix or repr(prefix)}: a name for the .pth file inside {folder_flag} (e.g. full_sft), not a path"


def minimind_settings(config: MiniMindConfig) -> dict:
    """Keyword arguments MiniMind's MiniMindConfig needs besides hidden_size, num_hidden_layers, use_moe.

    Our defaults are MiniMind's, so these are exactly the fields that differ from our defaults. MiniMind
    derives head_dim as hidden_size // num_attention_heads without a check, so its default head_dim is
    that quotient even where the default heads do not divide hidden_size or leave an odd head_dim, which
    our config refuses: the reference is built with a placeholder head_dim, then given MiniMind's."""
    reference = MiniMindConfig(hidden_size=config.hidden_size, use_moe=config.use_moe, head_dim=2)
    reference.head_dim = config.hidden_size // reference.num_attention_heads
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
    path = os.path.join(save_dir, minimind_pth_name(prefix, model.config.hidden_size, model.config.use_moe))
    write_minimind_pth(model, path)
    return path


def write_minimind_pth(model, path: str) -> None:
    """MiniMind's `torch.save({k: v.half() for k in model.state_dict()})`, lm_head.weight included,
    on the host (a file of GPU tensors loads only where that GPU is), each cast and copied before the next."""
    reason = minimind_unsupported(model.config)
    if reason:
        raise CheckpointError(f"this model has no MiniMind .pth form: {reason}")
    state = model.state_dict()
    atomic_torch_save({k: v.detach().to(device="cpu", dtype=torch.float16, copy=True) for k, v in state.items()},
                      path)
