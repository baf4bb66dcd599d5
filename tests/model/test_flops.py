"""model/flops.py: the model FLOPs of a batch (body, LM head at its positions, causal pairs) and MFU."""

import pytest
import torch

from dataset import SFTCollator
from model.flops import ModelFlops, body_parameters, causal_pairs, mfu, model_flops
from tests.helpers.tiny_model import tiny_model


def test_model_flops_count_the_body_the_head_at_its_positions_and_the_causal_pairs():
    model = tiny_model()  # hidden 64, 2 layers, 4 heads of 16, 2 kv heads, MLP 256, vocabulary 97 (tied)
    per_layer = 64 + 64 * 64 + 2 * (32 * 64) + 64 * 64 + 2 * 16 + 64 + 3 * (256 * 64)
    body = 2 * per_layer + 64  # + the final norm; the tied embedding / head is counted by the head term
    assert body_parameters(model) == body == 123264
    assert model_flops(model, computed_tokens=10, logit_positions=4, pairs=55) == (
        6 * body * 10 + 6 * 64 * 97 * 4 + 12 * 2 * (4 * 16) * 55) == 7629312


def test_an_moe_body_counts_its_router_and_the_top_k_of_its_experts():
    model = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=2)
    config = model.config
    expert = 3 * config.moe_intermediate_size * 64
    dense = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    assert body_parameters(model) == dense - 2 * (4 - 2) * expert  # per layer: 2 of 4 experts left out


def test_mfu_is_achieved_flops_per_second_over_the_peak():
    assert mfu(7629312 * 1000, 2.0, 1e10) == pytest.approx(7629312 * 1000 / 2.0 / 1e10)
    assert mfu(4e12, 2.0, 989.4e12) == pytest.approx(2e12 / 989.4e12)


def test_attention_pairs_are_counted_per_row_or_per_packed_document():
    padded = {"input_ids": torch.zeros(2, 4, dtype=torch.long)}
    assert causal_pairs(padded) == 2 * (4 * 5 // 2)
    # One row: documents of 3 and 2 tokens, then a pad (position 0: a 1-token document).
    packed = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]])}
    assert causal_pairs(packed) == 6 + 3 + 1


def test_a_collated_packed_batch_counts_its_documents_from_the_layout_the_collator_made():
    """A packed micro-batch as the trainer gets it: the pairs come from its `packed_layout` (documents
    of 3 and 2 tokens, then 3 pads, each a document of one token) and its logits at the positions
    given, every other term from its shape."""
    collate = SFTCollator(pad_token_id=0, pad_to_length=8)
    batch = collate([{"input_ids": torch.arange(1, 6).numpy(), "labels": torch.arange(1, 6).numpy(),
                      "position_ids": torch.tensor([0, 1, 2, 0, 1]).numpy()}])
    assert batch["packed_layout"].lengths.tolist() == [3, 2, 1, 1, 1]
    model = tiny_model()
    expected = 6 * 123264 * 8 + 6 * 64 * 97 * 3 + 12 * 2 * (4 * 16) * (6 + 3 + 1 + 1 + 1)
    assert ModelFlops(model).of_batch(batch, logit_positions=3) == expected == 6046848
    del batch["packed_layout"]  # from the position ids alone: the same documents
    assert ModelFlops(model).of_batch(batch, logit_positions=3) == expected
