"""scripts/profile_step.py: the host-side report (the GPU parts run only on a GPU)."""

import pytest
import torch
from torch.profiler import DeviceType, ProfilerActivity, profile

from scripts.profile_step import busy_seconds, gpu_op_report, host_report, parse_options


def test_busy_time_is_the_union_of_kernel_intervals():
    assert busy_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.5, 3.6)]) == 3.0


def test_host_report_lists_ops_by_self_cpu_time_per_step():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            (a @ b).relu_()
    averages = prof.key_averages()
    lines = host_report(averages, steps=2, wall=1.0, top=3)
    assert lines[0].startswith("host: ") and "of the wall time inside aten ops' own code" in lines[0]
    assert lines[1] == "top 3 host ops by self CPU time (ms per step, calls per step):"
    assert len(lines) == 5
    calls = {line.split()[-1]: float(line.split()[1]) for line in lines[2:]}
    assert calls["aten::mm"] == 2.0  # the largest self time: 4 calls over 2 steps
    first = float(lines[2].split()[0])
    assert first == max(float(line.split()[0]) for line in lines[2:])


def test_gpu_op_report_ranks_ops_by_their_own_gpu_time_per_step_with_shapes():
    from types import SimpleNamespace as Event

    def op(key, shapes, count, gpu_us, device_type=DeviceType.CPU):
        return Event(key=key, input_shapes=shapes, count=count, self_device_time_total=gpu_us, device_type=device_type)

    averages = [op("aten::mm", [[64, 8], [8, 16]], 6, 3000.0), op("aten::mul", [[64, 16], []], 4, 5000.0),
                op("aten::linear", [[64, 8]], 6, 0.0), op("aten::add", [[64, 16], [64, 16]], 2, 1000.0),
                # a kernel's own entry: the time of the op that launched it, again
                op("void elementwise_kernel<...>", [], 4, 5000.0, DeviceType.CUDA)]
    assert gpu_op_report(averages, steps=2, top=2) == [
        "top 2 ops by their own GPU time (ms per step, calls per step, input shapes):",
        "     2.500     2.0  aten::mul  [64, 16]",
        "     1.500     3.0  aten::mm  [64, 8] [8, 16]",
    ]
    without_shapes = [op("aten::mm", [], 2, 1000.0)]
    assert gpu_op_report(without_shapes, steps=1, top=5) == [
        "top 5 ops by their own GPU time (ms per step, calls per step):", "     1.000     2.0  aten::mm"]


def test_roofline_report_sets_each_ops_gpu_time_beside_its_estimate():
    """Joined by scripts/_step_bytes.profile_key: the profile's "aten::mm" is the trace's "mm" and the
    LM loss body's "matmul", a cast ("_to_copy") is the profile's "aten::copy_", overloads summed; an
    op the trace has not goes to the nearest traced op that called it, per step of the `steps`."""
    from types import SimpleNamespace as Event

    from scripts._step_bytes import OpTraffic
    from scripts.profile_step import roofline_report

    def op(key, gpu_us, parent=None, device_type=DeviceType.CPU):
        return Event(key=key, self_device_time_total=gpu_us, cpu_parent=parent, device_type=device_type)

    varlen, zeros = op("torch_attn::_varlen_attn", 0.0), op("aten::zeros", 0.0)
    events = [op("aten::mm", 30000.0), op("aten::copy_", 2000.0), op("aten::linear", 0.0), op("aten::mul", 1800.0),
              varlen, op("aten::_flash_attention_forward", 1200.0, varlen), zeros, op("aten::fill_", 200.0, zeros),
              op("aten::nonzero", 400.0), op("sm90_xmma_gemm_bf16", 30000.0, device_type=DeviceType.CUDA)]
    groups = {"mm": OpTraffic(seconds=0.010), "matmul": OpTraffic(seconds=0.002), "_to_copy": OpTraffic(seconds=0.001),
              "mul.Tensor": OpTraffic(seconds=0.0012), "mul.out": OpTraffic(seconds=0.0006),
              "torch_attn::_varlen_attn": OpTraffic(seconds=0.0004), "zeros": OpTraffic(seconds=0.0002),
              "add.Tensor": OpTraffic(seconds=0.003)}
    counter = Event(groups=groups, total=OpTraffic(seconds=0.0184))  # two steps
    assert roofline_report(events, counter, steps=2, top=6) == [
        "ops by their own GPU time against the step's roofline estimate, ms per step:",
        "       GPU estimate    ratio  op",
        "    15.000    6.000     2.50  mm",
        "     1.000    0.500     2.00  copy_",
        "     0.900    0.900     1.00  mul",
        "     0.600    0.200     3.00  _varlen_attn",
        "     0.200        -        -  nonzero",
        "     0.100    0.100     1.00  zeros",
        "    17.800    9.200     1.93  all ops",
    ]


def test_profile_keys_of_a_traced_step_are_the_profilers_op_keys():
    """The trace's names and torch.profiler's keys of the same ops meet at one key."""
    from scripts._step_bytes import profile_key

    traced = [torch.ops.aten.sub.Tensor, torch.ops.aten.mul.out, torch.ops.aten._to_copy.default,
              torch.ops.aten.matmul.default, torch.ops.aten._fused_adamw_.default]
    names = [op.name().removeprefix("aten::") for op in traced]  # as ByteCounter records them
    assert [profile_key(name) for name in names] == ["sub", "mul", "copy_", "mm", "_fused_adamw_"]
    assert [profile_key(key) for key in ("aten::sub", "aten::mul", "aten::copy_", "aten::mm",
                                         "aten::_fused_adamw_", "minisft_trace::_fused_rms_norm")] == [
        "sub", "mul", "copy_", "mm", "_fused_adamw_", "_fused_rms_norm"]


def test_roofline_needs_the_trainers_eager_step(capsys):
    import pytest

    from scripts.profile_step import parse_options

    for argv in (["--roofline", "1", "--use_compile", "1"], ["--roofline", "1", "--mode", "minimind"],
                 ["--roofline", "1", "--vocab_size", "151936"]):
        with pytest.raises(SystemExit):
            parse_options(argv)
        assert capsys.readouterr().err == ("error: --roofline sets the trainer's eager step against its trace: give "
                                           "--use_compile 0, no --vocab_size and a --mode of dynamic, grouped, "
                                           "packed\n")


def test_a_trace_file_that_cannot_be_written_is_refused_before_the_profile(tmp_path, capsys):
    (tmp_path / "notes").write_text("kept\n")
    for trace, line in ((tmp_path, f"--trace {tmp_path} is a directory: give a file name"),
                        (tmp_path / "notes" / "step.json",
                         f"--trace {tmp_path / 'notes' / 'step.json'}: {tmp_path / 'notes'} is a file, not a folder")):
        with pytest.raises(SystemExit) as stopped:
            parse_options(["--trace", str(trace)])
        assert (stopped.value.code, capsys.readouterr().err) == (2, f"error: {line}\n")
