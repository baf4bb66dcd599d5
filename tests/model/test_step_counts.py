"""What one training forward/backward dispatches (ops, casts, FLOPs), and the MoE experts against a
token-by-token reference. Counts are device-independent: they are asserted exactly."""

import re
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from model import MiniMindConfig, MiniMindForCausalLM
from scripts._dispatch_counts import DispatchCounter, flop_counter

PACKED_POSITIONS = [list(range(6)) + list(range(10))] * 2


def tiny(use_moe=False, top_k=1) -> MiniMindForCausalLM:
    torch.manual_seed(0)
    config = MiniMindConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=256, use_moe=use_moe, num_experts=4,
                            num_experts_per_tok=top_k)
    return MiniMindForCausalLM(config).train()


def training_pass(model, ids, dtype, packed=False):
    inputs = {"position_ids": torch.tensor(PACKED_POSITIONS)} if packed else {}
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = model(ids, labels=ids, skip_logits=True, **inputs)
        (out.loss + out.aux_loss).backward()
    return out


@pytest.mark.parametrize("use_moe, packed, ops, casts", [
    (False, False, 251, 12), (False, True, 321, 15), (True, False, 380, 24), (True, True, 450, 27),
])
def test_bf16_autocast_casts_each_block_once_and_runs_qkv_and_gate_up_as_one_gemm(use_moe, packed, ops, casts):
    # Per block one cast of its weights and one of their gradients; the embedding output, the RoPE
    # rows, the final norm's weight and the LM head's weight once each. (Autocast casting every
    # weight at every GEMM and every fp32 norm output again: 89 casts for the dense case.)
    model = tiny(use_moe)
    ids = torch.randint(3, 120, (2, 16))
    with DispatchCounter() as counter:
        training_pass(model, ids, torch.bfloat16, packed)
    assert (counter.total, counter.casts) == (ops, casts)
    # GEMMs of a block: q/k/v as one, o, then gate/up as one and down (dense) or the router (MoE), each
    # 3 times (forward, two in the backward); the chunked LM loss is one custom op each way.
    gemms_per_block = 3 if use_moe else 4
    assert counter.ops[torch.ops.aten.mm.default] == 2 * gemms_per_block * 3
    assert counter.ops[torch.ops.minisft.lm_loss_forward.default] == counter.ops[torch.ops.minisft.lm_loss_backward.default] == 1
    assert counter.ops[torch.ops.aten._grouped_mm.default] == (2 * 2 * 3 if use_moe else 0)


@pytest.mark.parametrize("use_moe", [False, True])
def test_bf16_parameters_without_autocast_run_qkv_and_gate_up_as_one_gemm_as_autocast_does(use_moe):
    """FSDP's bf16 parameters (and a bf16 model) need no cast: the groups still run as one GEMM
    each, the same GEMMs as fp32 weights under bf16 autocast, so the same loss and the same
    gradients, bit for bit. fp32 runs every weight on its own (nn.Linear's arithmetic)."""
    ids = torch.randint(3, 120, (2, 16))
    autocast, half = tiny(use_moe), tiny(use_moe).to(torch.bfloat16)
    with torch.no_grad():  # the bf16 model holds the values autocast computes with
        for target, source in zip(half.parameters(), autocast.parameters()):
            target.copy_(source.to(torch.bfloat16))
        for target, source in zip(autocast.parameters(), half.parameters()):
            target.copy_(source.float())
    expected = training_pass(autocast, ids, torch.bfloat16)
    with DispatchCounter() as counter:
        got = training_pass(half, ids, torch.float32)  # no autocast: the parameters' own dtype
    assert counter.ops[torch.ops.aten.mm.default] == 2 * (3 if use_moe else 4) * 3
    assert torch.equal(got.loss, expected.loss)
    for (name, param), reference in zip(half.named_parameters(), autocast.parameters()):
        if name != "model.embed_tokens.weight":  # tied to the LM head: its two gradients sum in the weights' dtype
            assert torch.equal(param.grad, reference.grad.to(torch.bfloat16)), name
    with DispatchCounter() as fp32:
        training_pass(tiny(use_moe), ids, torch.float32)
    assert fp32.ops[torch.ops.aten.mm.default] == 2 * (5 if use_moe else 7) * 3  # q, k, v, o apart


def test_bf16_residual_stream_and_norms_stay_in_the_compute_dtype():
    model = tiny()
    seen = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: seen.append(out[0].dtype)) for layer in model.model.layers]
    hooks.append(model.model.norm.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype)))
    training_pass(model, torch.randint(3, 120, (2, 16)), torch.bfloat16)
    assert seen == [torch.bfloat16] * 3
    for hook in hooks:
        hook.remove()


def reference_experts(moe, tokens, top_probs, top_experts):
    """Every token through each of its experts, one token at a time, weighted and summed."""
    rows = []
    for token, probs, experts in zip(tokens, top_probs, top_experts):
        total = torch.zeros_like(token)
        for prob, expert in zip(probs, experts.tolist()):
            mlp = moe.experts[expert]
            h = torch.nn.functional.silu(mlp.gate_proj(token)) * mlp.up_proj(token)
            total = total + mlp.down_proj(h) * prob
        rows.append(total)
    return torch.stack(rows)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_experts_equal_a_token_by_token_reference_in_values_and_gradients(top_k, monkeypatch):
    model = tiny(True, top_k)
    ids = torch.randint(3, 120, (2, 16))
    out = training_pass(model, ids, torch.float32)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for layer in model.model.layers:
        moe = layer.mlp
        monkeypatch.setattr(moe, "_experts", lambda t, p, e, _w, moe=moe: reference_experts(moe, t, p, e))
    reference = training_pass(model, ids, torch.float32)
    assert torch.allclose(out.loss, reference.loss, atol=1e-6, rtol=0)
    for grad, param in zip(grads, model.parameters()):
        assert torch.allclose(grad, param.grad, atol=1e-6, rtol=0)


def dense_dispatch(moe, tokens, top_probs, top_experts):
    """Every expert on every token, weighted by its routing weight (0 where the token is not routed to
    it) and summed: the dispatch without data-dependent shapes and with E/k times the experts' FLOPs."""
    weights = torch.zeros(tokens.shape[0], moe.num_experts).scatter(1, top_experts, top_probs).to(tokens.dtype)
    out = torch.zeros_like(tokens)
    for number, mlp in enumerate(moe.experts):
        hidden = torch.nn.functional.silu(mlp.gate_proj(tokens)) * mlp.up_proj(tokens)
        out = out + mlp.down_proj(hidden) * weights[:, number:number + 1]
    return out


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_output_and_gradients_equal_the_dense_dispatch_within_fp32_rounding(top_k, monkeypatch):
    """The grouped dispatch against running every expert on every token, in float32: the layer's output,
    its balance loss, the input's gradient and every parameter's (an expert no token reached: zero in both)."""
    from model.compute_weights import ComputeWeights, piece_layout

    moe = tiny(True, top_k).model.layers[0].mlp
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    results = []
    for dense in (False, True):
        if dense:
            monkeypatch.setattr(moe, "_experts", lambda t, p, e, _w: dense_dispatch(moe, t, p, e))
        moe.zero_grad()
        given = x.clone().requires_grad_()
        out, balance = moe(given, ComputeWeights(moe, torch.float32, piece_layout(moe, moe.weight_groups())))
        (out.square().sum() + balance.sum()).backward()
        results.append([out.detach(), balance.detach(), given.grad, *(p.grad for p in moe.parameters())])
    # sums in another order: fp32 rounding of the largest value (and at least 1e-9: with top-1 routing
    # and the top-k weights normalised, the router's gradient through them is zero up to rounding)
    for grouped, reference in zip(*results, strict=True):
        torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=max(1e-6 * reference.abs().max().item(), 1e-9))


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_layer_flops_are_the_routed_slots_only(top_k):
    model = tiny(True, top_k)
    moe, config = model.model.layers[0].mlp, model.config
    x = torch.randn(2, 16, config.hidden_size)
    from model.compute_weights import ComputeWeights, piece_layout

    counter = flop_counter()
    with counter:
        moe(x, ComputeWeights(moe, torch.float32, piece_layout(moe)))
    tokens, hidden, inner = 32, config.hidden_size, config.moe_intermediate_size
    router = 2 * tokens * hidden * config.num_experts
    experts = 2 * tokens * top_k * 3 * hidden * inner  # gate, up, down for each routed slot
    assert counter.get_total_flops() == router + experts


@pytest.mark.parametrize("hidden, dtype, backend", [(64, torch.float32, None), (64, torch.float32, "aot_eager"),
                                                     (64, torch.float16, "aot_eager"), (100, torch.bfloat16, None)])
def test_moe_training_flops_count_the_experts_however_their_grouped_gemm_runs(hidden, dtype, backend):
    """Forward and backward: the router's GEMM and every routed slot's gate, up and down, three times
    each, whether the grouped GEMM is aten's (counted by its formula) or runs inside the custom ops
    (`minisft::grouped_mm`, `minisft::experts_gradients`: compiled in float32 and float16, or operands
    the kernel takes only as padded copies, a hidden size of 100 in bf16)."""
    from model.compute_weights import ComputeWeights, piece_layout

    torch._dynamo.reset()
    config = MiniMindConfig(vocab_size=128, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=1,
                            num_key_value_heads=1, use_moe=True, num_experts=4, num_experts_per_tok=2)
    moe = MiniMindForCausalLM(config).train().model.layers[0].mlp.to(torch.float16 if dtype == torch.float16 else
                                                                      torch.float32)
    run = moe if backend is None else torch.compile(moe, backend=backend)
    x = torch.randn(2, 16, hidden, dtype=next(moe.parameters()).dtype, generator=torch.Generator().manual_seed(0))

    def training_pass():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out, balance = run(x.requires_grad_(), ComputeWeights(moe, dtype, piece_layout(moe, moe.weight_groups())))
        (out.float().square().sum() + balance.sum()).backward()

    training_pass()  # compiles
    with flop_counter() as counter:
        training_pass()
    tokens, inner = 32, config.moe_intermediate_size
    assert counter.get_total_flops() == 3 * (2 * tokens * hidden * 4 + 2 * tokens * 2 * 3 * hidden * inner)


def test_training_flops_count_the_lm_heads_gemms_inside_the_chunked_loss():
    """The chunked LM loss is one custom op each way: its GEMMs (the logits, computed again in the
    backward, and their two gradients) are counted with the body's."""
    model = tiny()
    ids = torch.randint(3, 120, (2, 16))
    with flop_counter() as counter:
        out = training_pass(model, ids, torch.float32)
    config = model.config
    body = sum(p.numel() for name, p in model.named_parameters() if name.endswith("proj.weight"))
    loss_positions = 2 * 15  # every next token has a label
    assert counter.get_total_flops() == 6 * body * 32 + 4 * 2 * loss_positions * config.hidden_size * config.vocab_size


def test_gqa_on_cuda_repeats_kv_heads_where_sdpa_would_fall_back_to_its_math_kernel(monkeypatch):
    """Only FlashAttention takes `enable_gqa` on CUDA: where SDPA's own check says it cannot run
    (float32, a pre-Ampere GPU, a head size it lacks) or a mask is given, the k/v heads are repeated."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from model import packed_attention
    from model.packed_attention import gqa_needs_expanded_heads

    asked = []

    def sdpa_flash_check(device_index, dtype, head_dim, backward):  # SDPA's check, as on an sm80+ GPU
        asked.append((dtype, head_dim, backward))
        return head_dim <= 256

    monkeypatch.setattr(packed_attention, "_ask_sdpa_flash", sdpa_flash_check)
    with FakeTensorMode():
        q, k = torch.empty(1, 4, 8, 16, device="cuda"), torch.empty(1, 2, 8, 16, device="cuda")
        assert gqa_needs_expanded_heads(q, k, masked=False)  # float32: no FlashAttention
        assert not gqa_needs_expanded_heads(q.bfloat16(), k.bfloat16(), masked=False)  # FlashAttention takes GQA
        assert not gqa_needs_expanded_heads(q.bfloat16().requires_grad_(), k.bfloat16(), masked=False)
        dtype = torch.get_autocast_dtype("cuda")
        torch.set_autocast_enabled("cuda", True)  # torch.autocast("cuda") turns itself off without a GPU
        torch.set_autocast_dtype("cuda", torch.float16)
        try:
            assert not gqa_needs_expanded_heads(q, k, masked=False)  # run in fp16 by autocast
        finally:
            torch.set_autocast_enabled("cuda", False)
            torch.set_autocast_dtype("cuda", dtype)
        assert gqa_needs_expanded_heads(q.bfloat16(), k.bfloat16(), masked=True)  # a padding mask at generation
        assert not gqa_needs_expanded_heads(q, q, masked=True)  # no GQA
        wide_q, wide_k = (torch.empty(1, heads, 8, 512, device="cuda", dtype=torch.bfloat16) for heads in (4, 2))
        assert gqa_needs_expanded_heads(wide_q, wide_k, masked=False)  # a head size FlashAttention lacks
        monkeypatch.setattr(packed_attention, "_ask_sdpa_flash", lambda *kind: False)  # e.g. a V100 in fp16
        assert gqa_needs_expanded_heads(q.half(), k.half(), masked=False)
    assert asked == [(torch.bfloat16, 16, False), (torch.bfloat16, 16, True), (torch.float16, 16, False),
                     (torch.bfloat16, 512, False)]
    assert not gqa_needs_expanded_heads(torch.empty(1, 4, 8, 16), torch.empty(1, 2, 8, 16), masked=False)  # CPU kernels


def test_varlen_kernel_is_not_chosen_for_a_head_dim_it_cannot_run():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from model.packed_attention import _flash_varlen_available

    with FakeTensorMode():
        assert not _flash_varlen_available(torch.empty(1, 4, 8, 12, device="cuda"))  # 12 is no multiple of 8


def cuda_autocast_float32_ops() -> tuple[set[str], set[str]]:
    """The ops CUDA autocast runs in float32 whatever their input (AT_FORALL_FP32 of the installed
    torch's ATen/autocast_mode.h), and those it runs in float32 unless given a dtype, which it
    keeps (AT_FORALL_FP32_SET_OPT_DTYPE). CPU autocast has its own lists, so a CPU run does not
    show what these do on a GPU."""
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.exists():
        pytest.skip(f"this torch ships no {header}")
    text = header.read_text()
    lists = []
    for macro in ("AT_FORALL_FP32(_)", "AT_FORALL_FP32_SET_OPT_DTYPE(_)"):
        body = text[text.index(f"#define {macro}"):]
        body = body[:body.index("\n\n")]
        lists.append(set(re.findall(r"_\((\w+)", body)))
    assert {"rsqrt", "pow"} <= lists[0] and {"sum", "softmax"} <= lists[1]
    return lists[0], lists[1]


@pytest.mark.parametrize("use_moe, packed", [(False, False), (False, True), (True, False)])
def test_no_half_precision_activation_meets_an_op_cuda_autocast_runs_in_float32(use_moe, packed):
    """Under CUDA bf16 autocast an op of those lists given a bf16 activation returns float32, and
    everything after it runs in float32 (the RMSNorm's pow and rsqrt did that to the whole residual
    stream, seen on an H100). The forward is traced on the CPU; no such op may see a bf16 input
    while autocast is on."""
    float32_ops, float32_unless_given_a_dtype = cuda_autocast_float32_ops()
    model = tiny(use_moe)
    ids = torch.randint(3, 120, (2, 16))
    seen = []

    class Inputs(TorchFunctionMode):  # above autocast: sees each call as the model makes it
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            tensors = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
            float32 = name in float32_ops or (
                name in float32_unless_given_a_dtype and (kwargs or {}).get("dtype") is None)
            if torch.is_autocast_enabled("cpu") and float32 and any(
                    t.dtype in (torch.bfloat16, torch.float16) for t in tensors):
                seen.append(name)
            return func(*args, **(kwargs or {}))

    inputs = {"position_ids": torch.tensor(PACKED_POSITIONS)} if packed else {}
    with Inputs(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, labels=ids, skip_logits=True, **inputs)
    assert seen == []


@pytest.mark.skipif(not torch.cuda._is_compiled(),
                    reason="a CPU build of torch aborts where autograd records a fake cuda tensor")
@pytest.mark.parametrize("use_moe, dtype, weights", [
    (False, torch.bfloat16, torch.float32), (False, torch.float16, torch.float32),
    (True, torch.bfloat16, torch.float32), (True, torch.bfloat16, torch.bfloat16),
])
def test_a_training_forward_on_a_fake_gpu_hands_the_gpu_kernels_the_compute_dtype(monkeypatch, use_moe, dtype,
                                                                                  weights):
    """The training forward (gradients recorded) of packed rows traced on a fake cuda device under
    CUDA autocast, with fp32 weights (a cast) or bf16 ones (FSDP's: none): the model's CUDA branches
    run, ATen's fused RMSNorm, FlashAttention's varlen kernel (SDPA's flash check answered as an sm80+
    GPU answers it, asked for a backward) on the collator's layout moved to the device, and the
    experts' grouped GEMM, each on operands in the compute dtype (the grouped GEMM's fast kernel takes
    bf16 only; its fallback copies the group ends to the host). The backward needs a GPU
    (tests/test_cuda.py); a CPU build of torch cannot record a fake cuda tensor."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from model import packed_attention
    from model.loss import loss_positions_of
    from model.packed_attention import PackedDocuments, document_starts

    asked, calls = [], []

    def sdpa_flash_check(device_index, half, head_dim, backward):
        asked.append((half, head_dim, backward))
        return True

    class Kernels(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._fused_rms_norm.default, torch.ops.torch_attn._varlen_attn.default,
                        torch.ops.aten._grouped_mm.default):
                tensors = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
                calls.append((func, {(t.device.type, t.dtype) for t in tensors}))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(packed_attention, "_ask_sdpa_flash", sdpa_flash_check)
    # pinning needs a GPU: the layout's copy to the device without it
    monkeypatch.setattr(packed_attention, "to_device", lambda tensor, device: tensor.to(device, non_blocking=True))
    model = tiny(use_moe, top_k=2).to(weights)
    ids = torch.randint(3, 120, (2, 16))
    positions = torch.tensor(PACKED_POSITIONS)
    layout = PackedDocuments(*document_starts(positions), positions.shape)  # as the collator builds them
    batch = dict(input_ids=ids, labels=ids, position_ids=positions, loss_positions=loss_positions_of(ids))
    saved = torch.get_autocast_dtype("cuda")
    with FakeTensorMode(allow_non_fake_inputs=True):
        gpu_model = model.to("cuda")
        inputs = {key: value.to("cuda") for key, value in batch.items()}
        torch.set_autocast_enabled("cuda", True)  # torch.autocast("cuda") turns itself off without a GPU
        torch.set_autocast_dtype("cuda", dtype)
        try:
            with Kernels():
                out = gpu_model(**inputs, packed_layout=layout, skip_logits=True)
        finally:
            torch.set_autocast_enabled("cuda", False)
            torch.set_autocast_dtype("cuda", saved)
    assert out.loss.requires_grad and out.loss.device.type == "cuda"
    assert set(asked) == {(dtype, 16, True)}
    layers = model.config.num_hidden_layers
    norms = [kinds for func, kinds in calls if func == torch.ops.aten._fused_rms_norm.default]
    assert len(norms) == 4 * layers + 1 and all(kinds == {("cuda", dtype)} for kinds in norms)
    varlen = [kinds for func, kinds in calls if func == torch.ops.torch_attn._varlen_attn.default]
    assert varlen == [{("cuda", dtype), ("cuda", torch.int32)}] * layers
    grouped = [kinds for func, kinds in calls if func == torch.ops.aten._grouped_mm.default]
    assert grouped == ([{("cuda", torch.bfloat16), ("cuda", torch.int32)}] * 2 * layers if use_moe else [])
