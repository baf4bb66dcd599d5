"""Run train_full_sft.py and record the dtype of every linear-layer output (`F.linear`, whether an
nn.Linear or the model's fused projections call it) computed in a training step (grad enabled): the
proof that autocast is in effect, which two losses cannot give (bf16 and fp32 may round to the same
loss). The sorted list goes to $MINISFT_DTYPE_REPORT on exit; `main_recording` does the same in
the calling process, for a test that runs the trainer there."""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def main_recording(argv: list[str], report: str) -> int:
    """train_full_sft.main(argv) with the dtypes of its training-step linear outputs written to `report`."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    import train_full_sft

    seen: set[str] = set()

    class RecordLinear(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            output = func(*args, **(kwargs or {}))
            if func is F.linear and torch.is_grad_enabled():
                seen.add(str(output.dtype))
            return output

    with RecordLinear():
        code = train_full_sft.main(argv)
    with open(report, "w", encoding="utf-8") as handle:
        json.dump(sorted(seen), handle)
    return code


if __name__ == "__main__":
    sys.exit(main_recording(sys.argv[1:], os.environ["MINISFT_DTYPE_REPORT"]))
