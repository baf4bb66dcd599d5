"""model/feed_forward.py: the MoE's grouped GEMMs take the dtype of the weights they are given."""

import torch
import torch.nn.functional as F

from model import feed_forward
from model.compute_weights import ComputeWeights
from tests.model.test_model import tiny_model


def test_moe_casts_its_tokens_where_grouped_mm_has_no_autocast_rule(monkeypatch):
    """On torch 2.11's CUDA autocast grouped_mm has no rule: float32 tokens meet bfloat16 expert
    weights and the GEMM refuses them. Stood in for here by a grouped_mm run with autocast off;
    the MoE's output equals the run where autocast casts for it."""
    model = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=2)
    moe = model.model.layers[0].mlp
    torch.manual_seed(1)
    x = torch.randn(2, 5, model.config.hidden_size)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return moe(x, ComputeWeights(moe, torch.bfloat16, moe.weight_groups()))[0]

    expected = run()

    grouped_mm = F.grouped_mm

    def grouped_mm_without_autocast(*args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(feed_forward.F, "grouped_mm", grouped_mm_without_autocast)
    assert torch.equal(run(), expected)
