"""model/feed_forward.py: the MoE's grouped GEMMs take the dtype of their weights; its balance loss is MiniMind's."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from model import feed_forward
from model.loss import loss_positions_of
from model.compute_weights import ComputeWeights, piece_layout
from tests.helpers.tiny_model import tiny_model


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
            return moe(x, ComputeWeights(moe, torch.bfloat16, piece_layout(moe, moe.weight_groups())))[0]

    expected = run()

    grouped_mm = F.grouped_mm

    def grouped_mm_without_autocast(*args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(feed_forward.F, "grouped_mm", grouped_mm_without_autocast)
    assert torch.equal(run(), expected)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_autograd_s_silu_times_up_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(0)
    joined = torch.randn(2, 5, 16, generator=generator).to(dtype).requires_grad_()
    reference = joined.detach().clone().requires_grad_()
    grad = torch.randn(2, 5, 8, generator=generator).to(dtype)
    out = feed_forward.swiglu(joined)
    gate, up = reference.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out.backward(grad)
    expected.backward(grad)
    assert torch.equal(out, expected) and torch.equal(joined.grad, reference.grad)


def test_bf16_mlp_gradient_is_written_in_place_not_concatenated():
    """Traced with fake tensors and the CUDA kernel choices (scripts/_step_bytes.py): the only
    concatenations of a dense bf16 training pass are each block's weight cast and its gradient,
    and q/k/v's gradient. A concatenated gate/up gradient ([2, 16, 2 x 256] bf16 per block) would
    add two calls and 65,536 bytes each way."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from model.loss import loss_positions_of
    from scripts._step_bytes import ByteCounter, cuda_kernel_choices, fake_parameters

    model = tiny_model()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_parameters(model, mode)
    ids = torch.randint(3, 90, (2, 16))
    positions = loss_positions_of(ids)  # on the host, as the collator computes them
    counter = ByteCounter()
    with mode, cuda_kernel_choices(counter), counter, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids, skip_logits=True, loss_positions=positions)
        out.loss.backward()
    cat = counter.groups["cat"]
    assert (cat.calls, cat.read, cat.written) == (6, 755_584, 755_584)
    # one `mul(out=)` per block's gate/up gradient, and one in the LM loss's backward (its one chunk)
    assert counter.groups["mul.out"].calls - 1 == counter.groups["silu_backward.grad_input"].calls == 2


def test_swiglu_gradient_with_create_graph_equals_autograd_s_and_refuses_a_second_order():
    """`backward(create_graph=True)` (a gradient penalty, say) gets autograd's first-order
    gradients; differentiating them again is refused in one clear error, not computed wrong."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64, generator=generator)
    weight = torch.randn(16, 4, dtype=torch.float64, generator=generator).requires_grad_()
    got = torch.autograd.grad(feed_forward.swiglu(x @ weight.t()).pow(2).sum(), weight, create_graph=True)[0]
    gate, up = (x @ weight.t()).chunk(2, dim=-1)
    expected = torch.autograd.grad((F.silu(gate) * up).pow(2).sum(), weight)[0]
    assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        got.sum().backward()


def moe_outputs_and_gradients(moe, x, dtype):
    """The MoE's output and balance loss on x and their gradients for x and every parameter, in
    `dtype` (bf16: under autocast, as the trainer runs it; float16: the module and x in it)."""
    moe.zero_grad()
    x = x.detach().to(torch.float16 if dtype == torch.float16 else torch.float32).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out, balance = moe(x, ComputeWeights(moe, dtype, piece_layout(moe, moe.weight_groups())))
    (out.float().square().sum() + balance.sum()).backward()
    return [out.detach(), balance.detach(), x.grad, *(p.grad for p in moe.parameters())]


@pytest.mark.parametrize("backend, dtype, op, hidden", [("eager", torch.float32, "minisft.grouped_mm", 64),
                                                        ("aot_eager", torch.float32, "minisft.grouped_mm", 64),
                                                        ("aot_eager", torch.float16, "minisft.grouped_mm", 64),
                                                        ("aot_eager", torch.bfloat16, "_grouped_mm", 64),
                                                        ("aot_eager", torch.bfloat16, "minisft.grouped_mm", 100)])
def test_a_compiled_moe_equals_eager_in_one_graph(backend, dtype, op, hidden):
    """torch.compile traces aten._grouped_mm with a shape function that refuses all but bf16: in
    float32 and float16 the experts' GEMMs are the op `minisft::grouped_mm`, in bf16 (autocast)
    aten's own, but for rows the kernel does not take as they are (a hidden size of 100 in bf16).
    Either way one graph without a break, and eager's output, balance loss and gradients bit for
    bit. Without a cast (float32, float16) the GEMMs run in `ExpertsGemm`, whose backward is the op
    `minisft::experts_gradients`."""
    from torch._dynamo.utils import counters

    model = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=2, hidden_size=hidden, num_attention_heads=2,
                       num_key_value_heads=1).train()
    moe = model.model.layers[0].mlp.to(torch.float16 if dtype == torch.float16 else torch.float32)
    x = torch.randn(2, 16, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = moe_outputs_and_gradients(moe, x, dtype)
    graphs = []

    def recording(graph, example_inputs):
        graphs.append(graph)
        return torch._dynamo.lookup_backend(backend)(graph, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    results = moe_outputs_and_gradients(torch.compile(moe, backend=recording), x, dtype)
    assert all(torch.equal(result, value) for result, value in zip(results, expected))
    assert results[0].dtype == dtype and len(graphs) == 1 and dict(counters["graph_break"]) == {}
    traced = [str(node.target) for graph in graphs[0].modules() if isinstance(graph, torch.fx.GraphModule)
              for node in graph.graph.nodes]
    calls = [call for call in traced if "grouped_mm" in call]
    assert len(calls) == 2 and all(op in call for call in calls), calls
    assert traced.count("minisft.experts_gradients.default") == (0 if dtype == torch.bfloat16 else 2)

def test_the_grouped_mm_op_gives_its_shapes_on_a_fake_gpu_in_float16():
    """A float16 CUDA run (V100, T4) under torch.compile: aten's shape function refuses it, the
    op's gives the experts' output and the weights' gradient (its two forms) on the device, in
    float16. (Autograd on a fake CUDA tensor needs a CUDA build: the backward is checked on the CPU.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        tokens = torch.empty(10, 64, device="cuda", dtype=torch.float16)
        weights = torch.empty(4, 96, 64, device="cuda", dtype=torch.float16)
        ends = torch.empty(4, device="cuda", dtype=torch.int32)
        with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
            torch._grouped_mm(tokens, weights.mT, offs=ends)
        out = feed_forward.grouped_mm_op(tokens, weights.mT, ends)
        grad_weights = feed_forward.grouped_mm_op(out.mT, tokens, ends)
    assert [(t.shape, t.stride(), t.device, t.dtype) for t in (out, grad_weights)] == [
        ((10, 96), (96, 1), torch.device("cuda", 0), torch.float16),
        ((4, 96, 64), (96 * 64, 64, 1), torch.device("cuda", 0), torch.float16)]

def test_the_grouped_mm_op_passes_torchs_custom_op_checks():
    """torch.library.opcheck: the schema, the autograd registration, the fake implementation against
    the real one (shapes, strides, dtypes) and AOT autograd with dynamic shapes."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(10, 8, generator=generator, requires_grad=True)
    weights = torch.randn(3, 12, 8, generator=generator, requires_grad=True)
    ends = torch.tensor([3, 3, 10], dtype=torch.int32)
    results = torch.library.opcheck(feed_forward.grouped_mm_op, (tokens, weights.mT, ends))
    assert set(results.values()) == {"SUCCESS"} and len(results) == 4


class AccumulatingIndexOps(TorchDispatchMode):
    """The ops dispatched inside it that add several values into one row of their output: atomic
    adds on a GPU, in whatever order its threads reach the row."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        given = {**dict(zip((a.name for a in func._schema.arguments), args)), **kwargs}
        name = func.overloadpacket.__name__
        if name in ("index_add", "index_add_") or (name in ("index_put", "index_put_", "_index_put_impl_")
                                                   and given.get("accumulate")):
            self.seen.append(str(func))
        return func(*args, **kwargs)


@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_forward_and_backward_add_no_rows_by_index_and_pass_torchs_deterministic_mode(top_k, dtype):
    moe = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=top_k).train().model.layers[0].mlp
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with AccumulatingIndexOps() as ops:
            moe_outputs_and_gradients(moe, x, dtype)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert ops.seen == []


def rowwise(rows: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """Each row times its own [K, M] weights in float32, rounded to the rows' dtype: a row's
    result does not depend on which rows are computed with it."""
    product = torch.bmm(rows.float().unsqueeze(1).contiguous(), row_weights.float().contiguous())
    return product.squeeze(1).to(rows.dtype)


def rowwise_grouped_mm(tokens, weights, ends):
    """`grouped_mm`, row by row."""
    groups = torch.searchsorted(ends, torch.arange(len(tokens), dtype=ends.dtype), right=True)
    return rowwise(tokens, weights[groups])


def test_bf16_moe_output_is_each_tokens_weighted_slots_summed_in_float32_whatever_the_expert_order(monkeypatch):
    """k = 3 in bf16, the experts' GEMMs stood in by a row-by-row product so that what is left is
    the combine: each token's output is its k weighted expert outputs (each rounded to bf16, as the
    product is) summed in float32 and rounded once, bit for bit. Numbering the experts the other
    way round sorts each token's slots the other way; output and input gradient stay bit for bit."""
    monkeypatch.setattr(feed_forward, "grouped_mm", rowwise_grouped_mm)
    moe = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=3).train().model.layers[0].mlp
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))
    routed = []
    experts = moe._experts
    monkeypatch.setattr(moe, "_experts", lambda *args: routed.append(args[1:3]) or experts(*args))
    out, _, x_grad, *_ = moe_outputs_and_gradients(moe, x, torch.bfloat16)
    top_probs, top_experts = routed[0]
    tokens = x.reshape(-1, 64).bfloat16()
    expected = torch.zeros(len(tokens), 64)
    for slot in range(3):
        for expert_number, expert in enumerate(moe.experts):
            gate_up = torch.cat([expert.gate_proj.weight, expert.up_proj.weight]).bfloat16().t()
            hidden = feed_forward.swiglu(rowwise(tokens, gate_up.expand(len(tokens), -1, -1)))
            expert_out = rowwise(hidden, expert.down_proj.weight.bfloat16().t().expand(len(tokens), -1, -1))
            weighted = (expert_out * top_probs[:, slot, None].bfloat16()).float()
            expected += torch.where(top_experts[:, slot, None] == expert_number, weighted, 0.0)
    assert out.dtype == torch.bfloat16 and torch.equal(out.view(-1, 64), expected.bfloat16())
    reverse = list(range(3, -1, -1))
    with torch.no_grad():
        moe.gate.weight.copy_(moe.gate.weight[reverse])
    moe.experts = torch.nn.ModuleList(moe.experts[i] for i in reverse)
    renumbered, _, renumbered_x_grad, *_ = moe_outputs_and_gradients(moe, x, torch.bfloat16)
    assert torch.equal(routed[1][1], 3 - top_experts)
    assert torch.equal(renumbered, out) and torch.equal(renumbered_x_grad, x_grad)


@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_the_experts_gradients_op_passes_torchs_custom_op_checks(needs):
    generator = torch.Generator().manual_seed(0)
    tokens, grad = torch.randn(10, 8, generator=generator), torch.randn(10, 12, generator=generator)
    weights = [torch.randn(6, 8, generator=generator) for _ in range(4)]
    ends = torch.tensor([3, 10], dtype=torch.int32)
    results = torch.library.opcheck(feed_forward.experts_gradients_op, (grad, tokens, weights, ends, *needs))
    assert set(results.values()) == {"SUCCESS"} and len(results) == 4


@pytest.mark.parametrize("use_moe", [False, True])
def test_compiled_blocks_evaluate_without_grad_as_eager_in_one_graph(use_moe):
    """An evaluation (`torch.no_grad`) through compiled blocks (--use_compile 1 with --eval_data_path):
    the joined GEMMs run without their autograd Function, whose apply dynamo (torch 2.13) cannot trace
    with grad disabled: a fake-tensor error in the experts' concatenation would stop an MoE run at its
    first evaluation. Eager's loss, one graph, no break."""
    model = tiny_model(use_moe=use_moe, num_experts=4, num_experts_per_tok=2).eval()
    ids = torch.randint(3, 97, (2, 48), generator=torch.Generator().manual_seed(0))
    inputs = dict(input_ids=ids, labels=ids, skip_logits=True, loss_positions=loss_positions_of(ids))
    with torch.no_grad():
        expected = model(**inputs).loss
        graphs = []

        def recording(graph, example_inputs):
            graphs.append(graph)
            return graph.forward

        torch._dynamo.reset()
        counters.clear()
        got = torch.compile(model, backend=recording)(**inputs).loss
    assert torch.allclose(got, expected, rtol=1e-6, atol=0)  # the MoE's differs in the last bit
    assert len(graphs) == 1 and dict(counters["graph_break"]) == {}


def looped_grouped_mm(a, b, ends):
    """`grouped_mm` as one matmul per group: a [N, K] by b [G, K, M], or a [M, N] by b [N, K] (the
    weights' gradient, [G, M, K])."""
    bounds = list(zip([0, *ends[:-1].tolist()], ends.tolist()))
    if b.dim() == 3:
        return torch.cat([a[start:end] @ b[group] for group, (start, end) in enumerate(bounds)])
    return torch.stack([a[:, start:end] @ b[start:end] for start, end in bounds])


class GroupedGemmContract(TorchDispatchMode):
    """Records every grouped GEMM and fails where the CUDA kernel would refuse an operand: its first
    element off a 16-byte address, or its rows (columns) a number of bytes apart that 16 does not
    divide. The CPU kernel checks the strides only. The kernel called from a custom op's
    implementation runs outside this mode: `F.grouped_mm` is watched as well."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.operands = []
        grouped_mm = F.grouped_mm

        def watched(a, b, *args, **kwargs):
            self.check(a, b)
            return grouped_mm(a, b, *args, **kwargs)

        monkeypatch.setattr(feed_forward.F, "grouped_mm", watched)

    def check(self, *operands):
        for operand in operands:
            rows, columns = operand.stride()[-2:]
            assert 1 in (rows, columns) and operand.data_ptr() % 16 == 0, (operand.shape, operand.stride())
            assert (rows if columns == 1 else columns) * operand.element_size() % 16 == 0, operand.stride()
        self.operands.append(operands)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default:
            self.check(*args[:2])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype, hidden", [(torch.bfloat16, 100), (torch.float32, 102), (torch.bfloat16, 64)])
def test_moe_of_any_hidden_size_hands_the_grouped_gemm_operands_it_takes(monkeypatch, dtype, hidden):
    """A hidden size whose rows are not a multiple of 16 bytes (100 in bf16, 102 in float32) trains:
    every grouped GEMM, forward and backward, gets operands the kernel takes (copies padded to 16
    bytes), and the MoE's output and gradients are the row-by-row products'. Where the rows are
    aligned (64) the experts' weights go to the kernel as they are, views of the cast buffer."""
    moe = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=2, hidden_size=hidden,
                     num_attention_heads=1, num_key_value_heads=1).train().model.layers[0].mlp
    x = torch.randn(2, 8, hidden, generator=torch.Generator().manual_seed(0))
    with GroupedGemmContract(monkeypatch) as contract:
        results = moe_outputs_and_gradients(moe, x, dtype)
    assert len(contract.operands) >= 6  # gate/up and down forward, two gradients of each
    gate_up = contract.operands[0][1]  # the experts' matrices, transposed views of their rows unless copied
    assert (gate_up.stride(-1) == 1) == (hidden != 64)
    monkeypatch.setattr(feed_forward, "grouped_mm", looped_grouped_mm)
    expected = moe_outputs_and_gradients(moe, x, dtype)
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    for result, reference in zip(results, expected):
        torch.testing.assert_close(result, reference, **tolerance)


def test_an_operand_at_an_address_off_16_bytes_goes_to_the_grouped_gemm_as_an_aligned_copy(monkeypatch):
    """Rows 16 bytes apart but the first one 2 bytes into its storage (a piece of a cast buffer after
    a parameter of odd size): the CPU kernel would take it, the CUDA kernel not. It is copied; the
    product is the same, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(1 + 6 * 8, generator=generator).bfloat16()[1:].view(6, 8)
    weights = torch.randn(2, 8, 16, generator=generator).bfloat16()
    ends = torch.tensor([2, 6], dtype=torch.int32)
    assert tokens.storage_offset() * tokens.element_size() % 16 != 0
    expected = F.grouped_mm(tokens.clone(), weights, offs=ends)
    with GroupedGemmContract(monkeypatch) as contract:
        out = feed_forward.grouped_mm(tokens, weights, ends)
    assert contract.operands and torch.equal(out, expected)
