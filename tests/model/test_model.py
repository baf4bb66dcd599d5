"""The MiniMind model: sizes, RoPE buffers, loss, masks, packing, KV cache, save/load, MoE."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from model import MiniMindConfig, MiniMindForCausalLM, count_parameters
from model.rope import precompute_rope_tables

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_config(**overrides) -> MiniMindConfig:
    settings = dict(
        vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )
    settings.update(overrides)
    return MiniMindConfig(**settings)


def tiny_model(seed=0, **overrides) -> MiniMindForCausalLM:
    torch.manual_seed(seed)
    return MiniMindForCausalLM(tiny_config(**overrides)).eval()


def test_default_parameter_count_matches_hand_count(capsys):
    config = MiniMindConfig()
    assert (config.head_dim, config.intermediate_size) == (96, 2432)  # ceil(768*pi/64)*64
    hidden, layers, vocab, inter, head_dim = 768, 8, 6400, 2432, 96
    kv = 4 * head_dim
    attention = hidden * hidden * 2 + hidden * kv * 2  # q, o + k, v
    mlp = 3 * hidden * inter
    norms = 2 * hidden + 2 * head_dim  # two block norms + q/k norms
    hand = vocab * hidden + layers * (attention + mlp + norms) + hidden  # tied head counted once
    assert hand == 63_912_192
    subprocess.run([sys.executable, "-m", "model"], cwd=REPO, check=True)  # the printing helper
    assert count_parameters(MiniMindForCausalLM(config))["total"] == hand
    out = subprocess.run([sys.executable, "-m", "model"], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("63.912M parameters")


def test_lm_head_is_tied_to_embedding():
    model = tiny_model()
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(hidden_size=66, num_attention_heads=4), "must divide hidden_size"),
        (dict(num_attention_heads=4, num_key_value_heads=3), "must divide num_attention_heads"),
        (dict(use_moe=True, num_experts=2, num_experts_per_tok=3), "num_experts_per_tok"),
        (dict(hidden_size=0), "hidden_size must be a positive integer"),
        (dict(rope_scaling={"type": "linear", "factor": 2}), "only YaRN"),
    ],
)
def test_invalid_config_raises_clear_value_error(bad, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**bad)


def test_rope_buffers_are_non_persistent_and_survive_dtype_round_trip():
    model = tiny_model()
    buffers = dict(model.named_buffers())
    assert set(buffers) == {"model.freqs_cos", "model.freqs_sin"}
    assert not any("freqs" in key for key in model.state_dict())
    assert not any("freqs" in name for name, _ in model.named_parameters())
    fresh_cos, fresh_sin = precompute_rope_tables(model.config)
    model.to(torch.bfloat16).to("cpu").to(torch.float32)
    assert model.model.freqs_cos.dtype == torch.float32
    assert torch.equal(model.model.freqs_cos, fresh_cos)
    assert torch.equal(model.model.freqs_sin, fresh_sin)
    model.to(torch.bfloat16)
    assert model.model.freqs_cos.dtype == torch.float32  # never rounded to bf16
    assert torch.equal(model.model.freqs_sin, fresh_sin)


def test_yarn_scaling_stretches_low_frequencies_only():
    plain_cos, plain_sin = precompute_rope_tables(tiny_config())
    yarn_config = tiny_config(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    cos, sin = precompute_rope_tables(yarn_config)
    scale = 0.1 * math.log(4.0) + 1.0  # YaRN's default attention factor
    assert torch.allclose(cos[0], torch.full_like(cos[0], scale))
    plain_angle = torch.atan2(plain_sin[1], plain_cos[1])  # = inverse frequency at position 1
    yarn_angle = torch.atan2(sin[1], cos[1])
    half = yarn_config.head_dim // 2
    # the fastest frequency is kept, the slowest is interpolated by `factor`
    assert yarn_angle[0].item() == pytest.approx(plain_angle[0].item(), rel=1e-5)
    assert yarn_angle[half - 1].item() == pytest.approx(plain_angle[half - 1].item() / 4.0, rel=1e-4)


def test_loss_equals_hand_written_shifted_cross_entropy():
    model = tiny_model()
    ids = torch.randint(0, 97, (3, 10))
    labels = ids.clone()
    labels[0, :4] = -100
    labels[2, 6:] = -100
    out = model(ids, labels=labels)
    logits = out.logits
    total, count = 0.0, 0
    for b in range(3):
        for t in range(9):
            target = labels[b, t + 1].item()
            if target == -100:
                continue
            total += -torch.log_softmax(logits[b, t].double(), -1)[target].item()
            count += 1
    assert out.loss.item() == pytest.approx(total / count, rel=1e-6)
    # labels of -100 count nothing: the hand computation above skips them, and the sum form agrees
    summed = model(ids, labels=labels, num_items_in_batch=7).loss
    assert summed.item() == pytest.approx(total / 7, rel=1e-6)
    only_loss = model(ids, labels=labels, skip_logits=True)
    assert only_loss.logits is None
    assert only_loss.loss.item() == pytest.approx(total / count, rel=1e-6)
    assert out.aux_loss.item() == 0.0


def test_all_ignored_labels_give_zero_loss_not_nan():
    model = tiny_model()
    ids = torch.randint(0, 97, (2, 6))
    out = model(ids, labels=torch.full_like(ids, -100))
    assert out.loss.item() == 0.0


def test_right_padding_does_not_change_real_token_logits():
    model = tiny_model()
    torch.manual_seed(1)
    short, long = torch.randint(3, 97, (5,)), torch.randint(3, 97, (9,))
    batch = torch.zeros(2, 9, dtype=torch.long)
    batch[0, :5], batch[1] = short, long
    mask = torch.zeros(2, 9, dtype=torch.long)
    mask[0, :5], mask[1] = 1, 1
    alone = model(short.unsqueeze(0)).logits[0]
    padded_masked = model(batch, attention_mask=mask).logits
    padded_unmasked = model(batch).logits  # right padding + causal: the mask is not even needed
    assert torch.allclose(padded_masked[0, :5], alone, atol=1e-5)
    assert torch.allclose(padded_unmasked[0, :5], alone, atol=1e-5)
    assert torch.allclose(padded_masked[1], model(long.unsqueeze(0)).logits[0], atol=1e-5)
    assert torch.isfinite(padded_masked).all()


@pytest.mark.parametrize("flash_attn", [True, False])
def test_packed_row_gives_each_document_its_own_logits(flash_attn):
    model = tiny_model(flash_attn=flash_attn)
    torch.manual_seed(2)
    doc_a, doc_b = torch.randint(3, 97, (6,)), torch.randint(3, 97, (4,))
    row = torch.cat([doc_a, doc_b, torch.zeros(2, dtype=torch.long)]).unsqueeze(0)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 0]])
    packed = model(row, position_ids=positions).logits[0]
    assert torch.allclose(packed[:6], model(doc_a.unsqueeze(0)).logits[0], atol=1e-5)
    assert torch.allclose(packed[6:10], model(doc_b.unsqueeze(0)).logits[0], atol=1e-5)


def packed_rows(lengths_per_row, row_len, seed=3):
    """Random packed rows: documents of the given lengths back to back, pads (position 0) after."""
    torch.manual_seed(seed)
    ids = torch.randint(3, 97, (len(lengths_per_row), row_len))
    positions = torch.zeros_like(ids)
    for row, lengths in enumerate(lengths_per_row):
        start = 0
        for n in lengths:
            positions[row, start:start + n] = torch.arange(n)
            start += n
        ids[row, start:] = 0
    return ids, positions


def test_packed_attention_matches_the_dense_document_mask_in_values_and_gradients():
    # Lengths spread over several power-of-two buckets, a row that is one document, pad tails.
    ids, positions = packed_rows([[1, 2, 3, 9, 17, 5], [40], [33, 2, 1, 1], [7, 7, 7, 7, 7]], row_len=40)
    reference, packed = tiny_model(flash_attn=False).train(), tiny_model(flash_attn=True).train()
    assert packed.model.layers[0].self_attn.use_sdpa and not reference.model.layers[0].self_attn.use_sdpa
    results = []
    for model in (reference, packed):
        out = model(ids, position_ids=positions, labels=ids)
        out.loss.backward()
        results.append((out.logits, out.loss, [p.grad for p in model.parameters()]))
    (ref_logits, ref_loss, ref_grads), (logits, loss, grads) = results
    assert torch.allclose(logits, ref_logits, atol=1e-5)
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    for ref_grad, grad in zip(ref_grads, grads):
        assert torch.allclose(grad, ref_grad, atol=1e-5)


def test_packed_attention_builds_no_dense_mask_and_pads_a_bucket_at_most_twofold():
    from model.packed_attention import PackedDocuments

    _, positions = packed_rows([[1, 2, 3, 9, 17, 5], [40]], row_len=40)
    layout = PackedDocuments.from_position_ids(positions)
    assert layout.cu_seqlens.tolist() == [0, 1, 3, 6, 15, 32, 37, 38, 39, 40, 80]
    assert layout.max_length == 40
    # (0,1]: the three 1-token pads and the 1-token document; (1,2]; (2,4]; (4,8]; (8,16]; (16,32]; (32,64]
    buckets, rows = layout.buckets
    shapes = [tuple(index.shape) for index in buckets]
    assert shapes == [(4, 1), (1, 2), (1, 3), (1, 5), (1, 9), (1, 17), (1, 40)]
    assert len(rows) == 80 and len(set(rows.tolist())) == 80  # one padded-output row per token
    start = 0
    for index in buckets:
        real = int(((rows >= start) & (rows < start + index.numel())).sum())
        assert index.numel() <= 2 * real
        start += index.numel()


def test_eager_and_sdpa_attention_agree():
    ids = torch.randint(0, 97, (2, 12))
    sdpa = tiny_model(flash_attn=True)(ids).logits
    eager = tiny_model(flash_attn=False)(ids).logits
    assert torch.allclose(sdpa, eager, atol=1e-5)


def test_greedy_generate_with_and_without_kv_cache_is_identical():
    model = tiny_model()
    prompt = torch.randint(3, 97, (2, 7))
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    with_cache = model.generate(prompt, use_cache=True, **kwargs)
    without = model.generate(prompt, use_cache=False, **kwargs)
    assert with_cache.shape == (2, 19)
    assert torch.equal(with_cache, without)


def test_left_padded_batch_generation_matches_single_prompts():
    model = tiny_model()
    short, long = torch.randint(3, 97, (4,)), torch.randint(3, 97, (7,))
    batch = torch.zeros(2, 7, dtype=torch.long)
    batch[0, 3:], batch[1] = short, long
    mask = (torch.arange(7) >= 3).long().unsqueeze(0).repeat(2, 1)
    mask[1] = 1
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    together = model.generate(batch, attention_mask=mask, **kwargs)
    assert torch.equal(together[0, 7:], model.generate(short.unsqueeze(0), **kwargs)[0, 4:])
    assert torch.equal(together[1, 7:], model.generate(long.unsqueeze(0), **kwargs)[0, 7:])


def test_save_pretrained_then_auto_load_in_fresh_process_gives_equal_logits(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    ids = torch.randint(0, 97, (2, 9))
    torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "expected.pt")
    # A fresh interpreter that never imports this repo: remote code from the saved directory.
    script = textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        expected = torch.load({str(tmp_path / 'expected.pt')!r})
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True).eval()
        assert type(model).__name__ == "MiniMindForCausalLM"
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert torch.equal(model(expected["ids"]).logits, expected["logits"]), "logits differ"
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK")


def test_auto_classes_know_minimind_in_process(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = tiny_model()
    model.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, MiniMindConfig) and config.hidden_size == 64
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 97, (1, 5))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, 97, (2, 10))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model().train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            assert model.model.layers[0].gradient_checkpointing
        model(ids, labels=ids).loss.backward()
        grads.append(model.model.layers[0].mlp.up_proj.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_moe_aux_loss_positive_and_every_expert_gets_gradient():
    model = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=2).train()
    ids = torch.randint(0, 97, (4, 16))
    out = model(ids, labels=ids)
    assert out.aux_loss.item() > 0
    (out.loss + out.aux_loss).backward()
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad.abs().sum() > 0
        for expert in layer.mlp.experts:
            assert expert.down_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("use_moe", [False, True])
def test_dense_and_moe_models_train_on_a_tiny_batch(use_moe):
    model = tiny_model(use_moe=use_moe).train()
    torch.manual_seed(3)
    ids = torch.randint(3, 97, (4, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        out = model(ids, labels=ids)
        (out.loss + out.aux_loss).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_autocast_forward_and_backward(dtype):
    model = tiny_model().train()
    ids = torch.randint(0, 97, (2, 8))
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = model(ids, labels=ids)
    assert out.logits.dtype == dtype
    out.loss.backward()
    grad = model.model.embed_tokens.weight.grad
    assert grad is not None and grad.dtype == torch.float32 and torch.isfinite(grad).all()
    assert torch.isfinite(out.loss)


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


# --------------------------------------------------------------------------- chunked loss, precomputed layout, MoE


def test_chunked_lm_loss_equals_the_unchunked_loss_and_gradients(monkeypatch):
    from model import modeling_minimind

    ids = torch.randint(3, 97, (3, 11))
    labels = ids.clone()
    labels[0, :5] = -100
    labels[2, 7:] = -100
    results = []
    for path in ("full logits", "unchunked", "chunked"):
        model = tiny_model().train()
        model.chunk_lm_loss = path == "chunked"
        if path == "chunked":  # 3 tokens x 97 logits per chunk: 7 chunks, the last one partial
            monkeypatch.setattr(modeling_minimind, "LOSS_CHUNK_ELEMENTS", 3 * 97)
            assert model.loss_chunk_tokens() == 3
        out = model(ids, labels=labels, num_items_in_batch=19, skip_logits=path != "full logits")
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    full_loss, full_grads = results[0]
    for loss, grads in results[1:]:
        assert torch.allclose(loss, full_loss, atol=1e-6, rtol=0)
        for name, grad in full_grads.items():
            assert torch.allclose(grads[name], grad, atol=1e-6, rtol=0), name
    # the function itself, with one chunk, several and a chunk larger than the input
    hidden, weight = torch.randn(20, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (20,))
    reference = F_cross_entropy_sum(hidden @ weight.t(), targets)
    ref_grads = torch.autograd.grad(reference, (hidden, weight))
    for chunk in (1, 7, 20, 64):
        total = modeling_minimind.chunked_lm_loss(hidden, weight, targets, chunk)
        grads = torch.autograd.grad(total * 0.5, (hidden, weight))
        assert torch.allclose(total, reference, atol=1e-5, rtol=1e-6)
        for grad, ref in zip(grads, ref_grads):
            assert torch.allclose(grad, 0.5 * ref, atol=1e-6, rtol=0)


def F_cross_entropy_sum(logits, targets):
    return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")


def test_forward_uses_the_collators_loss_positions_and_packed_layout_and_computes_none_itself(monkeypatch):
    from dataset import SFTCollator
    from model import modeling_minimind
    from model.packed_attention import PackedDocuments

    ids, positions = packed_rows([[5, 9, 3], [12, 4]], row_len=20)
    labels = torch.where(positions == 0, -100, ids)  # no loss on a document's first token
    items = [{"input_ids": ids[r, :n].numpy(), "labels": labels[r, :n].numpy(), "position_ids": positions[r, :n].numpy()}
             for r, n in enumerate((17, 16))]
    batch = SFTCollator(pad_token_id=0)(items)
    assert batch["input_ids"].shape == (2, 17)  # row 1: 16 tokens and a pad
    expected_positions = [17 * r + t for r in range(2) for t in range(16) if batch["labels"][r, t + 1] != -100]
    assert batch["loss_positions"].tolist() == expected_positions
    layout = batch["packed_layout"]
    assert layout.cu_seqlens.tolist() == [0, 5, 14, 17, 29, 33, 34]
    assert layout.max_length == 12 and layout.shape == (2, 17)

    model = tiny_model().train()
    plain = model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"], skip_logits=True)
    plain.loss.backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    def computed_here(*args, **kwargs):
        raise AssertionError("the model computed what the collator had given it")

    monkeypatch.setattr(modeling_minimind, "loss_positions_of", computed_here)
    monkeypatch.setattr(PackedDocuments, "from_position_ids", computed_here)
    given = model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"], skip_logits=True,
                  loss_positions=batch["loss_positions"], packed_layout=batch["packed_layout"])
    given.loss.backward()
    assert torch.equal(given.loss, plain.loss)
    for grad, plain_grad in zip([p.grad for p in model.parameters()], plain_grads):
        assert torch.allclose(grad, plain_grad, atol=1e-7, rtol=0)
    # the given positions are what the loss uses: the first half of them gives another loss
    half = batch["loss_positions"][: len(expected_positions) // 2]
    partial = model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"], skip_logits=True,
                    loss_positions=half, packed_layout=batch["packed_layout"]).loss
    assert not torch.allclose(partial, plain.loss)


def test_moe_balance_loss_is_minimind_sequence_wise_skips_pads_and_splits_over_rows_exactly():
    model = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1,
                       num_hidden_layers=1).train()
    torch.manual_seed(4)
    ids = torch.randint(3, 97, (4, 10))
    # MiniMind's seq_aux formula, written out for unpadded rows
    gate, experts, k = model.model.layers[0].mlp.gate, 4, 2
    captured = {}
    hook = model.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: captured.update(x=args[0]))
    whole = model(ids).aux_loss
    hook.remove()
    scores = gate(captured["x"]).softmax(-1)  # [B, T, E]
    top = scores.topk(k, dim=-1).indices.view(4, -1)
    ce = torch.zeros(4, experts).scatter_add_(1, top, torch.ones(4, 10 * k)).div_(10 * k / experts)
    minimind = (ce * scores.mean(dim=1)).sum(dim=1).mean() * 0.1
    assert whole.item() == pytest.approx(minimind.item(), rel=1e-6)
    # pads (token_mask 0) count nothing: a right-padded row has the balance of the row alone
    padded = torch.cat([ids[:1, :6], torch.zeros(1, 4, dtype=torch.long)], dim=1)
    mask = (torch.arange(10) < 6).long().unsqueeze(0)
    assert model(padded, token_mask=mask).aux_loss.item() == pytest.approx(model(ids[:1, :6]).aux_loss.item(), rel=1e-6)
    # split over micro-batches with the global row count: the same loss and gradient as one batch
    grads = []
    for parts in ([ids], [ids[:1], ids[1:]]):
        model.zero_grad()
        total = sum(model(part, num_sequences_in_batch=4).aux_loss for part in parts)
        total.backward()
        grads.append(gate.weight.grad.clone())
        assert total.item() == pytest.approx(whole.item(), rel=1e-6)
    assert torch.allclose(grads[0], grads[1], atol=1e-8, rtol=1e-6)


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
