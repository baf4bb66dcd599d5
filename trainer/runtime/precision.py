"""Mixed precision: which dtype the run computes in (`--dtype`), what float32 matmuls mean on a GPU
(`--tf32`), autocast around the forward pass, and the GradScaler that float16 needs (bfloat16 and
float32 do not scale the loss)."""

import contextlib

import torch

from trainer.errors import ConfigError
from trainer.runtime.distributed import all_reduce_sum_on_host


def resolve_dtype(name: str, device: torch.device, log=print) -> torch.dtype:
    """`--dtype` for `device`. auto: float32 on a CPU; on a GPU bfloat16 where it has bf16 natively
    (compute capability 8.0 or newer, or ROCm), else float16: an older GPU (V100, T4, RTX 20xx) has
    no bf16 tensor cores and no flash or memory-efficient SDPA kernel in bf16, so bf16 is emulated."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if cuda_has_native_bf16() else torch.float16
        return torch.float32
    dtype = getattr(torch, name)
    if dtype == torch.float16 and device.type == "cpu":
        raise ConfigError("--dtype float16 needs a GPU; on CPU use float32 or bfloat16")
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
        log("warning: --dtype bfloat16 on a CPU without native bf16 (no avx512_bf16 / amx_bf16): emulated, "
            "many times slower than float32 (use --dtype float32 here)")
    if dtype == torch.bfloat16 and device.type == "cuda" and not cuda_has_native_bf16():
        log("warning: --dtype bfloat16 on a GPU without native bf16 (compute capability below 8.0): emulated "
            "(no bf16 tensor cores, no fused attention kernel in bf16), much slower than float16 "
            "(use --dtype float16 here)")
    return dtype


def cuda_has_native_bf16() -> bool:
    """Whether every rank's GPU computes in bf16 natively (torch's default answer also counts a GPU
    that merely emulates it). One answer for the run (collective): ranks on GPUs of two generations
    would otherwise pick two dtypes, and DDP would average loss-scaled float16 gradients with
    unscaled bf16 ones."""
    lacking = torch.tensor([0 if torch.cuda.is_bf16_supported(including_emulation=False) else 1])
    return all_reduce_sum_on_host(lacking).item() == 0


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


TF32_CHOICES = ("auto", "0", "1")


def apply_tf32_policy(dtype: torch.dtype, tf32: str = "auto") -> bool:
    """The one precision policy of float32 matmuls and convolutions on CUDA (the trainer, the
    benchmark and the equivalence check call it): `--dtype float32` computes in IEEE float32; TF32
    tensor cores (10-bit mantissa inputs) serve what runs in float32 beside a bfloat16/float16
    autocast. `tf32` "1" or "0" overrides that. Returns whether TF32 is on.

    CUDA only, through the flags torch keeps in step with its newer `fp32_precision` settings
    (`torch.set_float32_matmul_precision` would also change CPU matmuls through oneDNN)."""
    if tf32 not in TF32_CHOICES:
        raise ConfigError(f"--tf32 {tf32}: use one of {', '.join(TF32_CHOICES)}")
    allowed = tf32 == "1" or (tf32 == "auto" and dtype in (torch.bfloat16, torch.float16))
    torch.backends.cuda.matmul.allow_tf32 = allowed
    torch.backends.cudnn.allow_tf32 = allowed
    return allowed


def autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


INITIAL_LOSS_SCALE = 2.0**16  # GradScaler's default


def build_grad_scaler(device: torch.device, dtype: torch.dtype) -> torch.amp.GradScaler:
    """Loss scaling is needed for float16 only; a disabled scaler is a no-op pass-through."""
    return torch.amp.GradScaler(device.type, init_scale=INITIAL_LOSS_SCALE, enabled=dtype == torch.float16)


def restart_collapsed_scale(scaler: torch.amp.GradScaler, finite: torch.Tensor) -> None:
    """After `scaler.update()`, on the device: a scale below 1 restarts at the initial one once a step
    is `finite` again, as on resume (`scaler_state_for_resume`). Each overflowing step halves the scale
    and GradScaler doubles it only after 2000 finite steps in a row, so overflows that never come
    --max_bad_steps in a row (a batch now and then whose float16 activations overflow, whatever the
    scale) collapse it for good: at 2**-16 nearly every float16 gradient underflows to zero, and the
    finite steps go on updating with those zeros. A non-finite step keeps the collapsed scale, so a
    streak of them is counted by --max_bad_steps (trainer/loop/health.py: record_step)."""
    scale, tracker = scaler._get_scale_async(), scaler._growth_tracker
    restart = finite & (scale < 1.0)
    scale.copy_(torch.where(restart, INITIAL_LOSS_SCALE, scale))
    tracker.copy_(torch.where(restart, 0, tracker))


def skip_also_where(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """After `scaler.unscale_(optimizer)`, on the device: the step is skipped where `skip` is true, as
    an overflowing one is (fused AdamW reads the scaler's found_inf, 1.0 for a skip)."""
    for found_inf in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
        torch.maximum(found_inf, skip.to(found_inf.device, found_inf.dtype), out=found_inf)


def scaler_state_for_resume(state: dict, log=print) -> dict:
    """The GradScaler state to resume with. A run stopped by --max_bad_steps (or saved within a
    burst of overflows) saved a collapsed scale (below 1: halved ~20 times); resuming with it would
    train for thousands of steps on underflowing gradients. Such a scale restarts at the initial one
    (the scaler calibrates down again within a few steps if it is still too large)."""
    if state and state.get("scale", INITIAL_LOSS_SCALE) < 1.0:
        log(f"resume: the checkpoint's fp16 loss scale {state['scale']:.3g} had collapsed; "
            f"starting again from {INITIAL_LOSS_SCALE:.0f}")
        state = {**state, "scale": INITIAL_LOSS_SCALE, "_growth_tracker": 0}
    return state
