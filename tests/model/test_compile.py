"""torch.compile of the model: one graph for any length, and compiled CPU gathers equal to eager."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.tiny_model import tiny_model
from tests.helpers.trainer_launch import REPO


def test_torch_compile_traces_the_body_as_one_graph_for_any_length():
    # Batches of varying length (dynamic shapes) must not make dynamo fall back to eager. With the
    # collator's loss positions the whole forward, chunked LM loss included (a custom op), is one graph.
    from model.loss import loss_positions_of

    model = tiny_model().train()
    ids = torch.randint(3, 97, (2, 12))
    torch._dynamo.mark_dynamic(ids, 1)
    explanation = torch._dynamo.explain(model)(ids, labels=ids, skip_logits=True, loss_positions=loss_positions_of(ids))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    assert sum("lm_loss_forward" in str(node.target) for node in explanation.graphs[0].graph.nodes) == 1
    body = explanation.graphs[0]
    assert sum(node.op == "call_function" and "scaled_dot_product_attention" in str(node.target)
               for node in body.graph.nodes) == model.config.num_hidden_layers


@pytest.mark.slow
def test_compiled_cpu_gathers_equal_eager(tmp_path):
    # torch 2.13's vectorized inductor C++ for int64-indexed gathers under dynamic shapes
    # corrupted the heap with AVX-512 and wrote out-of-range targets with AVX2; compile_model
    # generates scalar C++ on CPU. In a fresh process, so that a corrupted heap fails only this test.
    env = dict(os.environ, PYTHONPATH=REPO, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    result = subprocess.run([sys.executable, os.path.join(REPO, "tests", "helpers", "compiled_gathers_check.py")], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    worst = json.loads(result.stdout.strip().splitlines()[-1])
    assert worst["loss"] < 1e-5 and worst["grad"] < 1e-6, worst
