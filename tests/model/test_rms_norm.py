"""model/rms_norm.py: the hand-written backward equals autograd's, in fewer ops; on CUDA, ATen's
fused kernel."""

import pytest
import torch

from model.rms_norm import MiniMindRMSNorm
from scripts._dispatch_counts import DispatchCounter


def autograd_rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def leaves(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 4, 16, generator=generator).to(dtype).requires_grad_()
    weight = (1 + torch.randn(16, generator=generator)).to(dtype).requires_grad_()
    grad = torch.randn(3, 5, 4, 16, generator=generator).to(dtype)
    return x, weight, grad


def test_gradients_equal_autograd_s():
    norm = MiniMindRMSNorm(16, 1e-6)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 4e-2)):
        x, weight, grad = leaves(dtype)
        x_ref, weight_ref, _ = leaves(dtype)
        out = norm(x, weight)
        out.backward(grad)
        ref = autograd_rms_norm(x_ref, weight_ref, 1e-6)
        ref.backward(grad)
        assert out.dtype == dtype and torch.equal(out, ref)  # the forward is the same expression
        assert torch.allclose(x.grad, x_ref.grad, rtol=tol, atol=tol)
        assert torch.allclose(weight.grad, weight_ref.grad, rtol=tol, atol=tol)
    x, weight, _ = leaves(torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: norm(a, b), (x[:1, :2], weight))


def test_forward_and_backward_dispatch_15_ops_where_autograd_s_graph_dispatches_20():
    norm = MiniMindRMSNorm(16, 1e-6)
    counts = []
    for function in (norm, lambda a, b: autograd_rms_norm(a, b, 1e-6)):
        x, weight, grad = leaves(torch.bfloat16)
        with DispatchCounter() as counter:
            function(x, weight).backward(grad)
        counts.append(counter.total)
    assert counts == [15, 20]  # no zero-filled gradients for outputs nothing differentiates


def test_aten_s_rms_norm_the_gpu_runs_equals_the_closed_form_in_values_and_gradients():
    """The call the CUDA path makes (its eps, its normalized dimension), run on the CPU."""
    from model.rms_norm import aten_rms_norm

    norm = MiniMindRMSNorm(16, 1e-6)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        x, weight, grad = leaves(dtype)
        x_ref, weight_ref, _ = leaves(dtype)
        out, ref = aten_rms_norm(x, weight, 1e-6), norm(x_ref, weight_ref)
        out.backward(grad)
        ref.backward(grad)
        for a, b in ((out, ref), (x.grad, x_ref.grad), (weight.grad, weight_ref.grad)):
            assert torch.allclose(a, b, rtol=tol, atol=tol)
    x, weight, _ = leaves(torch.float64)
    small = (1e-3 * x).detach().requires_grad_()  # mean(x^2) near eps: eps is added where the closed form adds it
    assert torch.allclose(aten_rms_norm(small, weight, 1e-6), norm(small, weight), rtol=1e-12, atol=1e-12)


def test_a_cuda_tensor_goes_to_aten_s_rms_norm_in_its_own_dtype():
    """Traced on a fake CUDA device: the norm is one call of `F.rms_norm` (which a CUDA build of
    torch runs as its fused kernel, `_fused_rms_norm`: tests/test_cuda.py counts it), in the
    input's dtype. A CPU build has no CUDA kernels, so only the call can be seen here."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode

    calls = []

    class Calls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    norm = MiniMindRMSNorm(16, 1e-6)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(3, 4, 16, dtype=torch.bfloat16, device="cuda")
        weight = torch.empty(16, dtype=torch.bfloat16, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=False), Calls():
            out = norm(x, weight)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert [name for name in calls if "norm" in name or name == "apply"] == ["rms_norm"]


def test_runs_in_the_input_dtype_under_autocast_and_leaves_frozen_inputs_without_gradient():
    norm = MiniMindRMSNorm(16, 1e-6)
    x, _, grad = leaves(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)  # its own float32 weight, cast to x's dtype
    assert out.dtype == torch.bfloat16
    out.backward(grad)
    assert norm.weight.grad.dtype == torch.float32 and x.grad is not None
    frozen = torch.randn(2, 16, requires_grad=False)
    assert not norm(frozen, torch.ones(16)).requires_grad


def test_a_second_order_gradient_is_refused_not_computed_wrong():
    """The closed-form backward treats the forward's normed values as constants: its gradient is
    not the second derivative, so differentiating it again is refused in one clear error."""
    norm = MiniMindRMSNorm(16, 1e-6)
    x, weight, _ = leaves(torch.float64)
    got = torch.autograd.grad(norm(x, weight).pow(2).sum(), (x, weight), create_graph=True)
    expected = torch.autograd.grad(autograd_rms_norm(x, weight, 1e-6).pow(2).sum(), (x, weight))
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(got, expected))
    with pytest.raises(RuntimeError, match="differentiate twice"):
        got[0].sum().backward()


def test_float16_rows_with_an_rms_of_256_or_more_normalize_where_their_squares_overflow():
    """A float16 square overflows from 256 on: a constant row of 300 normalizes to ones (as ATen's
    F.rms_norm gives), its gradients those of the closed form."""
    import torch.nn.functional as F

    x = torch.full((1, 3), 300.0, dtype=torch.float16, requires_grad=True)
    weight = torch.ones(3, dtype=torch.float16, requires_grad=True)
    out = MiniMindRMSNorm(3, 1e-6)(x, weight)
    out.backward(torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float16))
    assert torch.equal(out, torch.ones(1, 3, dtype=torch.float16))
    assert torch.equal(F.rms_norm(x, (3,), weight, 1e-6), out)
    assert torch.equal(weight.grad, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16))
    assert torch.equal(x.grad, torch.tensor([[-1 / 300, 0.0, 1 / 300]], dtype=torch.float16))


def test_float16_output_and_gradients_are_the_float32_computation_rounded_to_float16():
    """Rows scaled from 0.01 to 1,000 (the largest ones' squares far over float16's largest value,
    65504): the statistics, n and the gradients in float32, each result rounded to float16 once;
    the forward is the written-out expression's in float32, the gradients the closed form's."""
    norm = MiniMindRMSNorm(16, 1e-6)
    x, weight, grad = leaves(torch.float16)
    with torch.no_grad():
        x.mul_(torch.logspace(-2, 3, 15).view(3, 5, 1, 1).half())
    wide_x, wide_weight = (t.detach().float().requires_grad_() for t in (x, weight))
    out = norm(x, weight)
    out.backward(grad)
    norm(wide_x, wide_weight).backward(grad.float())
    assert torch.equal(out, autograd_rms_norm(wide_x, wide_weight, 1e-6).half())
    assert torch.equal(x.grad, wide_x.grad.half()) and torch.equal(weight.grad, wide_weight.grad.half())
