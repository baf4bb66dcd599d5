"""The precision policy of float32 matmuls on CUDA (`--dtype`, `--tf32`), checked on CPU through the
flags torch keeps (no GPU needed to see what a CUDA run would be told)."""

import argparse
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.trainer_launch import REPO, clean_env, torchrun_cmd
from trainer.errors import ConfigError
from trainer.parallel import build_parallelism
from trainer.runtime import distributed
from trainer.runtime.precision import apply_tf32_policy, resolve_dtype


@pytest.fixture
def tf32_flags():
    """Leave torch's flags as the test found them."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize(("dtype", "tf32", "on"), [
    (torch.float32, "auto", False), (torch.bfloat16, "auto", True), (torch.float16, "auto", True),
    (torch.float32, "1", True), (torch.bfloat16, "0", False),
])
def test_float32_means_ieee_matmuls_and_tf32_comes_with_autocast_or_the_flag(tf32_flags, dtype, tf32, on):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not on
    mkldnn = torch.backends.mkldnn.matmul.fp32_precision
    assert apply_tf32_policy(dtype, tf32) is on
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (on, on)
    # torch's newer view of the same setting agrees (mixing the two APIs would make reads raise)
    assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if on else "ieee")
    assert torch.get_float32_matmul_precision() == ("high" if on else "highest")
    assert torch.backends.mkldnn.matmul.fp32_precision == mkldnn  # CPU matmuls untouched


def test_an_unknown_tf32_value_is_a_config_error():
    with pytest.raises(ConfigError, match="--tf32 yes: use one of auto, 0, 1"):
        apply_tf32_policy(torch.float32, "yes")


def test_picking_a_gpu_does_not_switch_tf32_on(tf32_flags, monkeypatch):
    """The device choice leaves precision to the policy: a float32 run on CUDA stays IEEE."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    ctx = distributed.init_distributed(argparse.Namespace(device="auto", local_rank=None, world_size=1))
    assert ctx.device == torch.device("cuda", 0)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


def test_the_trainer_keeps_sdpa_off_cudnn_attention():
    """cuDNN attention builds a plan per new shape; the trainer's batch lengths change every step
    (trainer/runtime/kernels.py): the process runs FlashAttention (or the memory-efficient kernel)."""
    from trainer.runtime.kernels import prefer_flash_attention

    saved = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        prefer_flash_attention()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(saved)


def fake_bf16_support(monkeypatch, native: bool):
    """torch.cuda.is_bf16_supported as on a GPU of compute capability 8.0+ (native) or below it (where
    torch's default, including_emulation=True, still says True)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)


@pytest.mark.parametrize(("native", "auto"), [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_picks_bfloat16_only_on_a_gpu_with_native_bf16(monkeypatch, native, auto):
    fake_bf16_support(monkeypatch, native)
    said = []
    gpu = torch.device("cuda", 0)
    assert resolve_dtype("auto", gpu, said.append) == auto
    assert resolve_dtype("float16", gpu, said.append) == torch.float16
    assert resolve_dtype("float32", gpu, said.append) == torch.float32
    assert said == []
    assert resolve_dtype("bfloat16", gpu, said.append) == torch.bfloat16
    assert said == ([] if native else [
        "warning: --dtype bfloat16 on a GPU without native bf16 (compute capability below 8.0): emulated "
        "(no bf16 tensor cores, no fused attention kernel in bf16), much slower than float16 "
        "(use --dtype float16 here)"])


@pytest.mark.slow
def test_ranks_on_gpus_of_two_generations_agree_on_the_auto_dtype():
    # two gloo processes, rank 1's GPU without native bf16: both pick float16
    result = subprocess.run([*torchrun_cmd(2), os.path.join(REPO, "tests", "helpers", "dtype_agreement_check.py")],
                            cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "picked: torch.float16 torch.float16" in result.stdout.splitlines(), result.stdout


def test_fsdp_with_auto_on_a_gpu_without_native_bf16_is_told_a_dtype_that_works_there(monkeypatch):
    fake_bf16_support(monkeypatch, native=False)
    dtype = resolve_dtype("auto", torch.device("cuda", 0))
    two = distributed.DistContext(rank=0, local_rank=0, world_size=2, device=torch.device("cuda", 0), backend="nccl")
    with pytest.raises(ConfigError) as refused:
        build_parallelism(SimpleNamespace(fsdp=1), two, dtype)
    assert str(refused.value) == (
        "--fsdp 1 trains in float32 or bfloat16, not float16 (it needs loss scaling; --dtype auto picks it on a "
        "GPU without native bf16): use --dtype bfloat16 on a GPU with compute capability 8.0 or newer, "
        "--dtype float32 on an older one")
