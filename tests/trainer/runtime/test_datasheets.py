"""trainer/runtime/datasheets.py: a GPU's datasheet peak, found by its device name."""

import pytest
import torch

from trainer.runtime.datasheets import datasheet_for, datasheet_peak


@pytest.mark.parametrize("device_name, sheet, bf16_tflops", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5),
    ("NVIDIA H200", "H200 SXM", 989.4),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5),
    ("NVIDIA GH200 480GB", "GH200", 989.4),
    ("NVIDIA H800", "H800 SXM", 989.4),
    ("NVIDIA H800 PCIe", "H800 PCIe", 756.0),
    ("NVIDIA H20", "H20", 148.0),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
    ("NVIDIA A100 80GB PCIe", "A100", 312.0),
    ("NVIDIA L4", "L4", 121.0),
    ("NVIDIA L40S", "L40S", 362.1),
    ("NVIDIA L40", "L40", 181.0),
    ("NVIDIA A10", "A10", 125.0),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090", 165.2),
    ("NVIDIA GeForce RTX 3090", "GeForce RTX 3090", 71.0),
    ("NVIDIA RTX A6000", "RTX A6000", 154.8),
])
def test_the_datasheet_is_found_by_the_device_name(device_name, sheet, bf16_tflops):
    found = datasheet_for(device_name)
    assert found.name == sheet
    assert found.peak("bfloat16") == found.peak("float16") == bf16_tflops * 1e12


def test_float32_is_compared_with_the_ieee_fp32_peak_and_unknown_gpus_have_no_datasheet():
    assert datasheet_for("NVIDIA H100 80GB HBM3").peak("float32") == 67.0e12  # not TF32's tensor-core figure
    assert datasheet_for("NVIDIA A10G") is None and datasheet_for("Tesla V100-SXM2-32GB") is None
    assert datasheet_for("NVIDIA GeForce GTX 1080") is None
    assert datasheet_for("NVIDIA GeForce RTX 4090 D") is None  # fewer cores than the 4090: not its figures


@pytest.fixture
def tf32_matmuls():
    """Sets whether float32 matmuls run on TF32 tensor cores (what `apply_tf32_policy` sets; a run in
    this process may have left it on); restored after the test."""
    before = torch.backends.cuda.matmul.allow_tf32

    def allow(on: bool) -> None:
        torch.backends.cuda.matmul.allow_tf32 = on

    yield allow
    torch.backends.cuda.matmul.allow_tf32 = before


def test_a_run_s_peak_is_its_gpu_s_datasheet_figure_for_its_dtype_and_none_elsewhere(monkeypatch, tf32_matmuls):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    tf32_matmuls(False)
    assert datasheet_peak(cuda, torch.bfloat16) == datasheet_peak(cuda, torch.float16) == 989.4e12
    assert datasheet_peak(cuda, torch.float32) == 67.0e12
    tf32_matmuls(True)  # --tf32 1: float32 matmuls at TF32's rate, which the table does not hold
    assert datasheet_peak(cuda, torch.float32) is None and datasheet_peak(cuda, torch.bfloat16) == 989.4e12
    assert datasheet_peak(torch.device("cpu"), torch.bfloat16) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B300")
    assert datasheet_peak(cuda, torch.bfloat16) is None
