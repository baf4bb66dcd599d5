"""Fixtures of the tests of trainer/weights/: the shipped tokenizer and two tiny Qwen3 directories."""

import os

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from dataset import load_tokenizer
from tests.helpers.tiny_weights import MOE, SHAPES


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory, tokenizer):
    """A tied dense Qwen3 (sharded, with tokenizer) and an untied Qwen3-MoE (no aux loss, with tokenizer)."""
    root = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), tie_word_embeddings=True, **SHAPES))
    dense.save_pretrained(root / "dense", max_shard_size="200KB")
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=len(tokenizer), tie_word_embeddings=False,
                                             router_aux_loss_coef=0.0, norm_topk_prob=False, **SHAPES, **MOE))
    moe.save_pretrained(root / "moe")
    for name in ("dense", "moe"):
        tokenizer.save_pretrained(root / name)
    assert os.path.isfile(root / "dense" / "model.safetensors.index.json")
    return {"dense": root / "dense", "moe": root / "moe", "models": {"dense": dense.eval(), "moe": moe.eval()}}
