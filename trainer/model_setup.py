"""Steps 3 and 5: the model config from the flags, the model (from scratch or `--from_weight`),
its DDP wrapper, the optimizer, and the mixed-precision pieces (autocast dtype, GradScaler)."""

import contextlib
import json
import os

import torch
from torch.nn.parallel import DistributedDataParallel

from model import MiniMindConfig, MiniMindForCausalLM
from trainer.checkpoint import CheckpointError, check_model_config

ROPE_BUFFERS = ("freqs_cos", "freqs_sin")


class ConfigError(ValueError):
    """Flags that do not describe a valid model or run."""


def build_model_config(args, tokenizer) -> MiniMindConfig:
    try:
        return MiniMindConfig(
            vocab_size=len(tokenizer),
            hidden_size=args.hidden_size,
            num_hidden_layers=args.num_hidden_layers,
            num_attention_heads=args.num_attention_heads,
            num_key_value_heads=args.num_key_value_heads,
            max_position_embeddings=max(32768, args.max_seq_len),
            dropout=args.dropout,
            use_moe=bool(args.use_moe),
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
            eos_token_id=tokenizer.eos_token_id,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from error


def build_model(args, config: MiniMindConfig, device: torch.device) -> MiniMindForCausalLM:
    """A fresh model (seeded by the caller), optionally initialised from `--from_weight`."""
    model = MiniMindForCausalLM(config)
    if args.from_weight not in ("none", ""):
        load_initial_weights(model, args.from_weight)
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device)


def load_initial_weights(model: MiniMindForCausalLM, path: str) -> None:
    """`path` is an HF model directory or a `.safetensors` file (with `config.json` beside it, optional)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if os.path.isdir(path):
        folder, weights = path, os.path.join(path, "model.safetensors")
    else:
        folder, weights = os.path.dirname(path), path
    if not os.path.isfile(weights):
        raise CheckpointError(f"--from_weight: {weights} does not exist")
    config_file = os.path.join(folder, "config.json")
    if os.path.isfile(config_file):
        try:
            with open(config_file, encoding="utf-8") as handle:
                saved = json.load(handle)
        except (OSError, json.JSONDecodeError) as error:
            raise CheckpointError(f"--from_weight: cannot read {config_file}: {error}") from error
        check_model_config(saved, model.config)
    try:
        state = load_file(weights)
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"--from_weight: {weights} is not a readable safetensors file ({error})") from error
    expected = model.state_dict()
    tied = model.config.tie_word_embeddings
    missing = [k for k in expected if k not in state and not (tied and k == "lm_head.weight")]
    unexpected = [k for k in state if k not in expected]
    wrong_shape = [k for k in state if k in expected and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong_shape:
        details = (f"missing {missing[:3]}" if missing else "") + (f" unexpected {unexpected[:3]}" if unexpected else "")
        details += f" wrong shape {wrong_shape[:3]}" if wrong_shape else ""
        raise CheckpointError(f"--from_weight: {weights} does not fit this model config:{details}")
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)


def wrap_for_distributed(model: MiniMindForCausalLM, ctx):
    """DDP that neither broadcasts nor syncs the RoPE tables (they are derived, identical everywhere).

    DDP matches the ignore list against fully-qualified names, e.g. `model.freqs_cos`.
    """
    if not ctx.distributed:
        return model
    ignore = [name for name, _ in model.named_buffers() if name.rsplit(".", 1)[-1] in ROPE_BUFFERS]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
    return DistributedDataParallel(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        find_unused_parameters=model.config.use_moe,  # an expert may get no token in a micro-batch
    )


def unwrap(model):
    """The plain MiniMindForCausalLM behind DDP and/or torch.compile."""
    model = getattr(model, "_orig_mod", model)
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def build_optimizer(model: MiniMindForCausalLM, args, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms), fused kernels on CUDA."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95), fused=device.type == "cuda")


def resolve_dtype(name: str, device: torch.device, log=print) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    dtype = getattr(torch, name)
    if dtype == torch.float16 and device.type == "cpu":
        raise ConfigError("--dtype float16 needs a GPU; on CPU use float32 or bfloat16")
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
        log("warning: --dtype bfloat16 on a CPU without native bf16 (no avx512_bf16 / amx_bf16): emulated, "
            "many times slower than float32 (use --dtype float32 here)")
    return dtype


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU has bf16 arithmetic (x86 avx512_bf16 or AMX, Arm bf16). True when unknown
    (no /proc/cpuinfo, e.g. macOS): the warning is only for CPUs known to lack it."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return True
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    if not flags:
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


INITIAL_LOSS_SCALE = 2.0**16  # GradScaler's default


def build_grad_scaler(device: torch.device, dtype: torch.dtype) -> torch.amp.GradScaler:
    """Loss scaling is needed for float16 only; a disabled scaler is a no-op pass-through."""
    return torch.amp.GradScaler(device.type, init_scale=INITIAL_LOSS_SCALE, enabled=dtype == torch.float16)


def scaler_state_for_resume(state: dict, log=print) -> dict:
    """The GradScaler state to resume with. A run stopped by --max_bad_steps (or by a burst of
    overflows) saved a collapsed scale (below 1: halved ~20 times); resuming with it would train
    for thousands of steps on underflowing gradients. Such a scale restarts at the initial one
    (the scaler calibrates down again within a few steps if it is still too large)."""
    if state and state.get("scale", INITIAL_LOSS_SCALE) < 1.0:
        log(f"resume: the checkpoint's fp16 loss scale {state['scale']:.3g} had collapsed; "
            f"starting again from {INITIAL_LOSS_SCALE:.0f}")
        state = {**state, "scale": INITIAL_LOSS_SCALE, "_growth_tracker": 0}
    return state
