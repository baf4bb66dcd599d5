"""scripts/_bench_flops.py: the model FLOPs formula, the datasheet peak by GPU name, MFU."""

import pytest
import torch

import scripts._bench_flops as flops
from scripts._bench_flops import causal_pairs, datasheet_for, mfu, model_flops, peak_flops
from tests.helpers.tiny_model import tiny_model


@pytest.mark.parametrize("device_name, sheet, bf16_tflops", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5),
    ("NVIDIA H200", "H200 SXM", 989.4),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5),
    ("NVIDIA GH200 480GB", "GH200", 989.4),
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


def test_model_flops_count_the_body_the_head_at_its_positions_and_the_causal_pairs():
    model = tiny_model()  # hidden 64, 2 layers, 4 heads of 16, 2 kv heads, MLP 256, vocabulary 97 (tied)
    per_layer = 64 + 64 * 64 + 2 * (32 * 64) + 64 * 64 + 2 * 16 + 64 + 3 * (256 * 64)
    body = 2 * per_layer + 64  # + the final norm; the tied embedding / head is counted by the head term
    assert flops.body_parameters(model) == body == 123264
    assert model_flops(model, computed_tokens=10, logit_positions=4, pairs=55) == (
        6 * body * 10 + 6 * 64 * 97 * 4 + 12 * 2 * (4 * 16) * 55) == 7629312


def test_an_moe_body_counts_its_router_and_the_top_k_of_its_experts():
    model = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=2)
    config = model.config
    expert = 3 * config.moe_intermediate_size * 64
    dense = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    assert flops.body_parameters(model) == dense - 2 * (4 - 2) * expert  # per layer: 2 of 4 experts left out


def test_mfu_is_achieved_flops_per_second_over_the_peak():
    assert mfu(7629312 * 1000, 2.0, 1e10) == pytest.approx(7629312 * 1000 / 2.0 / 1e10)
    assert mfu(4e12, 2.0, 989.4e12) == pytest.approx(2e12 / 989.4e12)


def test_attention_pairs_are_counted_per_row_or_per_packed_document():
    padded = {"input_ids": torch.zeros(2, 4, dtype=torch.long)}
    assert causal_pairs(padded) == 2 * (4 * 5 // 2)
    # One row: documents of 3 and 2 tokens, then a pad (position 0: a 1-token document).
    packed = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]])}
    assert causal_pairs(packed) == 6 + 3 + 1
