"""scripts/bench_memory.py: the measured per-rank bytes of weights + gradients + AdamW state are
exactly the storages a rank holds (tiny models, exact byte counts)."""

import math

import pytest
import torch

from model import MiniMindConfig, MiniMindForCausalLM
from scripts.bench_memory import held_bytes, main, materialise, run
from tests.helpers.tiny_model import tiny_model

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def adamw_after_one_step(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return optimizer


def test_held_bytes_counts_weights_gradients_and_adamw_state_once_each():
    model = tiny_model().train()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one tensor, counted once
    optimizer = adamw_after_one_step(model)
    parameters = list(model.parameters())
    numel = sum(p.numel() for p in parameters)
    # float32 weight, gradient, exp_avg and exp_avg_sq per element, plus AdamW's float32 step counter per tensor
    assert held_bytes(model, optimizer) == 4 * numel * 4 + len(parameters) * 4
    # gradients that are views into one flat buffer (as FSDP's reduce-scatter output) count as that buffer
    flat = torch.zeros(numel + 10)  # 10 elements of padding: held too
    offset = 0
    for parameter in parameters:
        parameter.grad = flat[offset:offset + parameter.numel()].view_as(parameter)
        offset += parameter.numel()
    assert held_bytes(model, optimizer) == 3 * numel * 4 + (numel + 10) * 4 + len(parameters) * 4
    for parameter in parameters:
        parameter.grad = None
    assert held_bytes(model, optimizer) == 3 * numel * 4 + len(parameters) * 4


def test_materialise_keeps_the_tied_head_and_builds_the_rope_tables():
    config = MiniMindConfig(**TINY)
    with torch.device("meta"):
        model = MiniMindForCausalLM(config)
    materialise(model, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = MiniMindForCausalLM(config)
    assert torch.equal(model.model.freqs_cos, reference.model.freqs_cos)
    assert torch.equal(model.model.norm.weight, torch.ones(TINY["hidden_size"]))


def test_bad_flags_are_one_line_errors(capsys):
    for argv, message in ((["--processes", "1,x"], "--processes 1,x: expected process counts like 1,2,4"),
                          (["--processes", "0"], "--processes 0: every count must be 1 or more"),
                          (["--models", "minisft,gpt5"], "--models: unknown gpt5; choose from minisft, qwen3-0.6b")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_fsdp_on_two_processes_holds_half_of_one_process_measured_after_a_real_step():
    with torch.device("meta"):
        model = MiniMindForCausalLM(MiniMindConfig(**TINY))
    parameters = list(model.parameters())
    numel = sum(p.numel() for p in parameters)
    steps = len(parameters) * 4  # AdamW's step counters: one float32 per tensor on every rank
    total, _, computed, measured, peak = run(1, False, TINY)
    assert (total, computed, measured, peak) == (numel, 4 * numel * 4, 4 * numel * 4 + steps, None)
    # rank 0 holds the first ceil(dim0 / 2) rows of every tensor (FSDP pads, here nothing to pad)
    shard = sum(math.ceil(p.shape[0] / 2) * p[0].numel() for p in parameters)
    assert shard * 2 == numel
    _, _, computed, measured, _ = run(2, True, TINY)
    assert (computed, measured) == (4 * shard * 4, 4 * shard * 4 + steps)
