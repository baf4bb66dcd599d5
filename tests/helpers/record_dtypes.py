"""Run train_full_sft.py and record the dtype of every nn.Linear output computed in a training
step (grad enabled): the proof that autocast is in effect, which two losses cannot give (bf16 and
fp32 may round to the same loss). The sorted list goes to $MINISFT_DTYPE_REPORT on exit."""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

if __name__ == "__main__":
    import torch

    import train_full_sft

    seen: set[str] = set()

    def record(module, inputs, output) -> None:
        if isinstance(module, torch.nn.Linear) and torch.is_grad_enabled():
            seen.add(str(output.dtype))

    torch.nn.modules.module.register_module_forward_hook(record)
    code = train_full_sft.main(sys.argv[1:])
    with open(os.environ["MINISFT_DTYPE_REPORT"], "w", encoding="utf-8") as handle:
        json.dump(sorted(seen), handle)
    sys.exit(code)
