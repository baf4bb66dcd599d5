"""scripts/_step_bytes.py: the byte counter counts exactly; the traced step takes the CUDA kernel
choices, and its forward equals one traced on a fake cuda device; step_figures --bytes prints it."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts._step_bytes import ESTIMATE_CARD, ByteCounter
from scripts.step_figures import main
from tests.scripts.test_step_figures import DEMO, TINY

REPO = Path(__file__).resolve().parents[2]


def test_counter_counts_bytes_read_and_written_exactly():
    x = torch.ones(4, 6)  # 96 bytes
    index = torch.tensor([0, 2])  # 16 bytes
    with ByteCounter(bandwidth=1e3, peak=1e6) as counter:
        x.t()  # a view: nothing
        z = x * 2  # reads 96, writes 96
        z.add_(x)  # reads both, writes z
        w = torch.empty(4, 6)  # an allocation writes nothing
        w.copy_(z)  # reads the source only
        torch.ones(1).expand(4, 6) + x  # the broadcast tensor is read at its storage's 4 bytes
        x.new_zeros(3)  # reads no value of x
        torch.mul(x, x, out=w)  # reads x once, does not read `out`
        x.index_select(0, index)  # reads the 2 picked rows (48 bytes) and the index
        torch.mm(torch.ones(8, 16), torch.ones(16, 4))  # 1,024 FLOPs
        with torch._C._AutoDispatchBelowAutograd():  # as inside a custom op: `to` itself, not `_to_copy`
            x.to(torch.float32)  # x itself: nothing
            x.to(torch.bfloat16)  # a cast: reads 96, writes 48
    got = {name: (t.calls, t.read, t.written, t.flops) for name, t in counter.groups.items()}
    assert got == {
        "mul.Tensor": (1, 96, 96, 0), "add_.Tensor": (1, 192, 96, 0), "empty.memory_format": (1, 0, 0, 0),
        "copy_": (1, 96, 96, 0), "ones": (3, 0, 4 + 512 + 256, 0), "add.Tensor": (1, 100, 96, 0),
        "new_zeros": (1, 0, 12, 0), "mul.out": (1, 96, 96, 0), "index_select": (1, 64, 48, 0),
        "mm": (1, 768, 128, 1024), "to.dtype": (1, 96, 48, 0),
    }
    mm = counter.groups["mm"]
    assert mm.seconds == max(896 / 1e3, 1024 / 1e6)  # the roofline: here bandwidth-bound
    assert counter.total.bytes == sum(t.bytes for t in counter.groups.values())


def test_logsumexp_below_autograd_is_counted_as_the_passes_aten_makes():
    x = torch.randn(3, 5)
    with ByteCounter() as counter, torch._C._AutoDispatchBelowAutograd():
        got = x.logsumexp(-1)
    assert torch.equal(got, x.logsumexp(-1))
    assert {name: (t.read, t.written) for name, t in counter.groups.items() if t.read > 20} == {
        "amax": (60, 12), "sub.Tensor": (72, 60), "exp_": (60, 60), "sum.dim_IntList": (60, 12), "add_.Tensor": (24, 12)}


def test_a_scatter_touches_as_many_elements_of_its_target_as_its_source_holds():
    target, grid = torch.zeros(10, 4), torch.zeros(3, 5)  # 160 and 60 bytes
    with ByteCounter() as counter:
        target.index_add_(0, torch.tensor([1, 3]), torch.ones(2, 4))  # 2 rows of 4: 32 bytes each way
        grid.scatter_add_(1, torch.tensor([[0], [2], [4]]), torch.ones(3, 1))  # 3 elements: 12 bytes
    got = {name: (t.calls, t.read, t.written) for name, t in counter.groups.items() if name.endswith("_")}
    assert got == {"index_add_": (1, 32 + 16 + 32, 32), "scatter_add_": (1, 12 + 24 + 12, 12)}


FAKE_CUDA_FORWARD = """
import json, sys
from tests.scripts.test_step_bytes import forward_groups
print(json.dumps([forward_groups("cuda"), forward_groups("cpu")]))
"""


def forward_groups(device: str) -> dict:
    """Bytes by op of a bf16 packed forward of a tiny model's body, traced with fake tensors:
    on "cuda" with the CUDA device's own branches and CUDA autocast (a CPU build of torch has no
    fused RMSNorm kernel, which is stood in for as in the step trace, and no device to ask for
    sm80); on "cpu" with `cuda_kernel_choices`. Run in a child process: a CPU build has no CUDA
    device guard, so one is borrowed for the run from the PrivateUse1 guard that torch lets
    Python register (a forward needs only its type)."""
    import contextlib
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode

    import model.packed_attention as packed_attention
    import model.rms_norm as rms_norm
    from model.packed_attention import PackedDocuments
    from scripts._step_bytes import cuda_kernel_choices, fake_parameters, fused_rms_norm
    from tests.helpers.tiny_model import tiny_model

    model = tiny_model().model.train()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_parameters(model, mode, device)
    positions = torch.tensor([list(range(6)) + list(range(10))] * 2)
    layout = copy.copy(PackedDocuments.from_position_ids(positions))
    counter = ByteCounter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mode)
        if device == "cuda":
            _borrow_a_cuda_device_guard()
            stack.enter_context(torch.no_grad())  # autograd asks the CUDA device for its streams
            stack.enter_context(mock.patch.object(rms_norm, "aten_rms_norm",
                                                  lambda x, w, eps: fused_rms_norm(x, w, eps)[0]))
            stack.enter_context(mock.patch.object(packed_attention, "_ask_sdpa_flash", lambda *kind: True))
        else:
            stack.enter_context(cuda_kernel_choices(counter))
        torch.set_autocast_enabled(device, True)  # torch.autocast("cuda") turns itself off without a GPU
        torch.set_autocast_dtype(device, torch.bfloat16)
        ids = torch.empty(positions.shape, dtype=torch.long, device=device)
        layout.device, layout.cu_seqlens = torch.device(device), layout.cu_seqlens.to(device) if device == "cpu" else \
            torch.empty(layout.cu_seqlens.shape, dtype=torch.int32, device=device)
        counter.layout_pairs = {id(layout): 0}
        with counter:
            model(ids, position_ids=torch.empty_like(ids), packed_layout=layout)
        torch.set_autocast_enabled(device, False)
    return {name: [t.calls, t.read, t.written] for name, t in counter.groups.items()}


def _borrow_a_cuda_device_guard() -> None:
    import ctypes
    import os

    if torch.cuda._is_compiled():
        return
    guard_type = torch._C._autograd.DeviceType.CUDA

    class CudaGuard(torch._C._acc.DeviceGuard):
        def type_(self):
            return guard_type

    _borrow_a_cuda_device_guard.kept = CudaGuard()
    torch._C._acc.register_python_privateuseone_device_guard(_borrow_a_cuda_device_guard.kept)
    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    registry = (ctypes.c_void_p * 32).in_dll(library, "_ZN3c104impl26device_guard_impl_registryE")
    registry[1] = registry[20]  # DeviceType::CUDA <- DeviceType::PrivateUse1


def test_traced_forward_equals_a_forward_traced_on_a_fake_cuda_device():
    result = subprocess.run([sys.executable, "-c", FAKE_CUDA_FORWARD], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    on_cuda, traced = json.loads(result.stdout.strip().splitlines()[-1])
    assert on_cuda == traced
    assert {"_fused_rms_norm", "torch_attn::_varlen_attn"} <= set(traced)


def test_step_figures_bytes_prints_every_op_of_a_step(capsys, tmp_path):
    data = tmp_path / "train.jsonl"
    with open(DEMO, encoding="utf-8") as source:
        data.write_text("".join(line for _, line in zip(range(48), source)), encoding="utf-8")
    argv = [*TINY, "--data_path", str(data), "--cache_dir", str(tmp_path / "cache"), "--packing", "1", "--bytes",
            "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    groups = result["groups"]
    assert result["bytes"] == sum(g["read"] + g["written"] for g in groups.values())
    assert groups["_fused_adamw_"]["calls"] == 2  # one per parameter group, as on a GPU
    assert groups["_foreach_norm.Scalar"]["calls"] == groups["_foreach_mul_.Tensor"]["calls"] == 1  # clipping
    assert groups["_fused_rms_norm"]["calls"] == groups["_fused_rms_norm_backward"]["calls"] == 2 * 4 + 1
    forward, backward = groups["torch_attn::_varlen_attn"], groups["torch_attn::_varlen_attn_backward"]
    assert forward["calls"] == backward["calls"] == 2 and 2 * backward["flops"] == 5 * forward["flops"] > 0
    assert groups["addcmul_"]["calls"] == 2 * 2 * 2 * 2  # RoPE: 2 layers x q, k x 2 per rotation x both ways
    assert "roll" not in groups and "cat" in groups
    assert 0 < result["roofline_ms"]


def test_a_float32_step_is_set_against_the_fp32_peak(capsys, tmp_path):
    """--dtype float32 runs IEEE float32 GEMMs (no TF32): its roofline takes the fp32 peak, not the bf16 one."""
    data = tmp_path / "train.jsonl"
    with open(DEMO, encoding="utf-8") as source:
        data.write_text("".join(line for _, line in zip(range(16), source)), encoding="utf-8")
    peaks = []
    for dtype in ("float32", "bfloat16"):
        argv = [*TINY, "--data_path", str(data), "--cache_dir", str(tmp_path / "cache"), "--dtype", dtype, "--bytes", "--json"]
        assert main(argv) == 0
        peaks.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["peak_flops_per_s"])
    assert peaks == [ESTIMATE_CARD.peak("float32"), ESTIMATE_CARD.peak("bfloat16")] == [67.0e12, 989.4e12]


@pytest.mark.parametrize("argv, line", [
    (["--top", "3"], "--top needs --bytes"),
    (["--by_shapes"], "--by_shapes needs --bytes"),
    (["--measured_ms", "172"], "--measured_ms needs --bytes"),
    (["--bytes", "--use_compile", "1"], "--bytes traces the eager step: leave out --use_compile"),
    (["--bytes", "--use_compile=1"], "--bytes traces the eager step: leave out --use_compile"),
])
def test_flags_that_would_do_nothing_are_refused_in_one_line(capsys, argv, line):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {line} (see ")


def test_flash_attention_flops_count_the_causal_pairs_only():
    q = torch.ones(1, 2, 4, 8, requires_grad=True)  # 1 row of 4 tokens: 10 causal pairs, 2 heads of 8
    with ByteCounter() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    forward = counter.groups["_scaled_dot_product_flash_attention_for_cpu"].flops
    backward = counter.groups["_scaled_dot_product_flash_attention_for_cpu_backward"].flops
    assert (forward, backward) == (4 * 10 * 2 * 8, 10 * 10 * 2 * 8)


def test_by_shapes_keeps_calls_of_one_op_on_other_shapes_apart():
    with ByteCounter(by_shapes=True) as counter:
        torch.ones(2, 3, dtype=torch.bfloat16) * 2
        torch.ones(4) * 2
    assert {name: t.bytes for name, t in counter.groups.items() if name.startswith("mul")} == {
        "mul.Tensor [2, 3]:bfloat16": 24, "mul.Tensor [4]:float32": 32}


def test_fused_adamw_reads_four_tensors_a_parameter_and_writes_three():
    param = torch.nn.Parameter(torch.zeros(10))
    param.grad = torch.ones(10)
    optimizer = torch.optim.AdamW([param], fused=True)
    optimizer.step()  # creates the moments
    with ByteCounter() as counter:
        optimizer.step()
    adamw = counter.groups["_fused_adamw_"]
    assert (adamw.read, adamw.written) == (4 * 40 + 4, 3 * 40)  # and the step counter; the gradient is not unscaled


def test_several_steps_are_summed(data):
    """measure_bytes(..., steps=2): the two steps after the warm-up, each op's counts summed (the
    dense step's ops do not depend on the batch: twice one step's calls)."""
    from scripts._step_bytes import measure_bytes

    flags = [*TINY, "--data_path", str(data / "train.jsonl"), "--cache_dir", str(data / "cache"), "--batch_size", "2"]
    one, two = measure_bytes(flags), measure_bytes(flags, steps=2)
    assert {name: 2 * traffic.calls for name, traffic in one.groups.items()} == {
        name: traffic.calls for name, traffic in two.groups.items()}
    assert two.total.bytes > one.total.bytes
