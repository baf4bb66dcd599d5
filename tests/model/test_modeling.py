"""model/modeling_minimind.py: padding, attention kinds, generation with a KV cache, save and load, training."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from model import MiniMindConfig
from tests.helpers.tiny_model import tiny_model


def test_lm_head_is_tied_to_embedding():
    model = tiny_model()
    assert model.lm_head.weight is model.model.embed_tokens.weight


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


def test_a_decode_step_that_sdpa_would_not_take_with_gqa_reads_the_cache_unexpanded(monkeypatch):
    """Where CUDA's SDPA takes no GQA (a padding mask, float32), a decode step's query heads run as
    the rows of their k/v head: the cache is never repeated, the answers and logits are those of
    SDPA's own GQA (here the CPU's)."""
    from model import modeling_minimind

    model = tiny_model()
    batch = torch.randint(3, 97, (2, 7))
    batch[0, :3] = 0
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    kwargs = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0,
                  output_logits=True, return_dict_in_generate=True)
    native = model.generate(batch, attention_mask=mask, **kwargs)
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **options):
        calls.append((tuple(q.shape), tuple(k.shape)))
        return sdpa(q, k, v, **options)

    monkeypatch.setattr(modeling_minimind, "gqa_needs_expanded_heads", lambda q, k, masked: True)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    folded = model.generate(batch, attention_mask=mask, **kwargs)
    assert torch.equal(folded.sequences, native.sequences)
    for ours, theirs in zip(folded.logits, native.logits):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    layers = model.config.num_hidden_layers
    decode = [((2, 2, 2, 16), (2, 2, 7 + step, 16)) for step in range(1, 5) for _ in range(layers)]
    assert calls[-len(decode):] == decode


def test_a_padded_prompt_batch_runs_as_documents_not_a_dense_mask(monkeypatch):
    """A prefill of padded prompts (position_ids and an attention mask, no cache: generation's) runs
    each pad as a document of its own and the real tokens as theirs, the packed path, with the dense
    mask's logits for every real token; a row with pads between its real tokens keeps the dense mask."""
    from model import modeling_minimind
    from model.packed_attention import PackedDocuments

    model = tiny_model()
    ids = torch.randint(3, 97, (3, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, 6:] = 0  # right padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    positions[0, :3] = 1  # pads' positions as transformers' generate gives them
    built = []
    monkeypatch.setattr(modeling_minimind.AttentionMask, "__init__", lambda self, allowed, is_causal, documents=None:
                        built.append(allowed) or self.__dict__.update(allowed=allowed, is_causal=is_causal,
                                                                       documents=documents))
    logits = model(ids, attention_mask=mask, position_ids=positions).logits
    assert built == [None]
    with monkeypatch.context() as dense:
        dense.setattr(PackedDocuments, "of_padded_rows", classmethod(lambda cls, positions, mask: None))
        expected = model(ids, attention_mask=mask, position_ids=positions).logits
    assert built[1].shape == (3, 1, 8, 8)
    torch.testing.assert_close(logits[mask.bool()], expected[mask.bool()], rtol=0, atol=1e-5)
    holes = mask.clone()
    holes[2, 4] = 0
    assert PackedDocuments.of_padded_rows(positions, holes) is None


def test_a_static_kv_cache_is_refused_in_one_line():
    """A static cache's keys span its whole length (zeros past the tokens seen), which this attention
    would read as tokens: refused, not a shape error from inside a layer."""
    model = tiny_model()
    with pytest.raises(ValueError) as raised:
        model.generate(torch.randint(3, 97, (1, 5)), max_new_tokens=3, do_sample=False, pad_token_id=0,
                       cache_implementation="static")
    assert str(raised.value) == ("MiniMindModel: a static KV cache (cache_implementation='static') is not supported: "
                                 "its keys span the whole cache, not the tokens seen; use the default dynamic cache")


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
