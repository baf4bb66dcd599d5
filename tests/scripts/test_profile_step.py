"""scripts/profile_step.py: the host-side report (the GPU parts run only on a GPU)."""

import torch
from torch.profiler import DeviceType, ProfilerActivity, profile

from scripts.profile_step import busy_seconds, gpu_op_report, host_report


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
