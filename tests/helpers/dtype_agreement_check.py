"""Run by tests/trainer/runtime/test_precision.py under torchrun (2 processes, gloo): rank 1's GPU
lacks native bf16 (faked); rank 0 prints the dtype `--dtype auto` gives each rank on a GPU."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from trainer.runtime.precision import resolve_dtype  # noqa: E402

if __name__ == "__main__":
    dist.init_process_group("gloo")
    native = dist.get_rank() == 0
    torch.cuda.is_bf16_supported = lambda including_emulation=True: native or including_emulation
    picked = [None, None]
    dist.all_gather_object(picked, str(resolve_dtype("auto", torch.device("cuda", 0))))
    if dist.get_rank() == 0:
        print("picked:", *picked, flush=True)
    dist.destroy_process_group()
