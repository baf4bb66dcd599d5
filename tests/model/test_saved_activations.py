"""What a block's forward keeps for its backward, in bytes per token: bf16 autocast over fp32
parameters, the training setting. Counted with `saved_tensors_hooks`, each memory (storage) once,
the parameters left out, as the difference between two token counts (the cast weights and the
RoPE rows do not grow with the tokens, or are counted in the first block)."""

import pytest
import torch

from tests.helpers.tiny_model import tiny_model

H, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
BF16, FP32, INT64 = 2, 4, 8


def attention_half() -> int:
    """Bytes per token of a block's norm and attention, the lean set: the norm's input (the residual
    stream) and its 1 / rms, the q/k/v GEMM's input, that GEMM's output (q and k are the q/k norms'
    inputs, v the attention's), q and k after RoPE, the attention's output (o_proj's input, the
    same memory) and its log-sum-exp (fp32), the q/k norms' 1 / rms per head."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    activations = H + H + (q + 2 * kv) + (q + kv) + q
    return BF16 * activations + BF16 * (1 + HEADS + KV_HEADS) + FP32 * HEADS


def dense_mlp_half(intermediate: int) -> int:
    """The post-attention norm's input and 1 / rms, gate/up's input, gate/up's output (SwiGLU's
    input) and SwiGLU's product (down's input)."""
    return BF16 * (H + 1) + BF16 * (H + 2 * intermediate + intermediate)


def moe_mlp_half(intermediate: int, experts: int, k: int) -> int:
    """The norm as the dense block's, the router's input and softmax (fp32), topk's indices, the
    top-k renormalization's operands (fp32), the dispatched tokens (k copies: the experts' GEMM
    input), the slots' rows and their order (int64), gate/up's output and SwiGLU's product per slot,
    the experts' outputs back in slot order and the routing weights (bf16) that weigh them."""
    norm_and_router = BF16 * (H + 1) + BF16 * H + FP32 * experts
    routing = INT64 * k + FP32 * (k + 1) + INT64 * k + INT64 * k + BF16 * k
    slots = BF16 * k * (H + 2 * intermediate + intermediate + H)
    return norm_and_router + routing + slots


def block_bytes(model, tokens: int, block: int = 1) -> int:
    """Bytes that block `block` of `model` saves, each storage once: no parameter, nothing that an
    earlier block saved too (the RoPE rows)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, seen, total = [False], set(), [0]
    layer = model.model.layers[block]
    hooks = [layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
             layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))]

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            total[0] += storage.nbytes() if inside[0] else 0
        return tensor

    ids = torch.randint(3, 97, (1, tokens), generator=torch.Generator().manual_seed(0))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, labels=ids, skip_logits=True)
    finally:
        for hook in hooks:
            hook.remove()
    return total[0]


def per_token(model) -> float:
    return (block_bytes(model, 64) - block_bytes(model, 32)) / 32


def test_a_dense_block_saves_the_lean_set_per_token():
    """A kept silu(gate) (SwiGLU's, [.., I] per token) or normed q and k beside the q/k/v GEMM's
    output that the attention keeps for v would add 2 x I and 2 x (q + k) bytes per token."""
    model = tiny_model().train()
    intermediate = model.config.intermediate_size
    assert per_token(model) == attention_half() + dense_mlp_half(intermediate) == 2656


def test_a_moe_block_saves_the_lean_set_per_token():
    model = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=2).train()
    intermediate = model.config.moe_intermediate_size
    assert per_token(model) == attention_half() + moe_mlp_half(intermediate, 4, 2) == 4784


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_norm_saves_its_input_and_statistics_not_a_normed_copy(dtype):
    from model.rms_norm import rms_norm

    x = torch.randn(3, 5, 16).to(dtype).requires_grad_()
    weight = torch.ones(16, dtype=dtype, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rms_norm(x, weight, 1e-6)
    assert [tuple(t.shape) for t in saved] == [(16,), (3, 5, 16), (3, 5, 1)]
    assert saved[1] is x


def test_swiglu_saves_its_input_only():
    from model.feed_forward import swiglu

    gate_up = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(gate_up)
    assert len(saved) == 1 and saved[0] is gate_up
