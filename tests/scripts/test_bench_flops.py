"""scripts/_bench_flops.py: the peak a benchmark compares with, from the datasheet or a timed matmul."""

import torch

import scripts._bench_flops as flops
from scripts._bench_flops import peak_flops


def test_a_gpu_in_the_table_is_named_and_one_outside_it_gets_a_matmul_timed_with_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    measured = []
    monkeypatch.setattr(flops, "measured_peak", lambda device, dtype, size: measured.append((device, dtype, size)) or 5e14)
    cuda = torch.device("cuda", 0)
    assert peak_flops(cuda, "bfloat16", 8192) == (989.4e12, "datasheet of the H100 SXM (NVIDIA H100 80GB HBM3), dense")
    assert measured == []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B300")
    assert peak_flops(cuda, "bfloat16", 8192) == (
        5e14, "best 8192^3 matmul timed with CUDA events (NVIDIA B300 is not in the datasheet table)")
    assert measured == [(cuda, torch.bfloat16, 8192)]


def test_a_cpu_peak_is_measured_with_a_matmul():
    peak, source = peak_flops(torch.device("cpu"), "float32", 64)
    assert peak > 0 and source == "best 64^3 matmul on this CPU"
