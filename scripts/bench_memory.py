"""Per-rank memory of weights + gradients + AdamW state under DDP and under FSDP2 (`--fsdp 1`).

    python scripts/bench_memory.py                      # table for 1, 2 and 4 processes
    python scripts/bench_memory.py --processes 1,2,4,8

For each model (the trainer's default MiniMind and a Qwen3-0.6B-shaped one, random weights) and
each process count N, N real processes (gloo, CPU) build the model on the meta device (no memory),
wrap it exactly as the trainer does (trainer/fsdp.py shard_model for FSDP; DDP keeps the whole
model) and add up the bytes of the tensors each rank owns: its float32 weights, a float32
gradient of the same shape and AdamW's two float32 moments (both the shape of the weight). The
figure is the largest rank's (FSDP pads a dimension that N does not divide onto the first ranks).

Not counted: activations, and under FSDP the one block whose full weights are all-gathered while
it runs (its parameters x the bytes of --dtype, shown as "+ gathered block").
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from trainer.distributed import free_port  # noqa: E402
from trainer.fsdp import shard_model  # noqa: E402

MODELS = {
    # the trainer's defaults (--hidden_size 768 --num_hidden_layers 8, the shipped 6400-token vocabulary)
    "minisft default (768 x 8)": dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=8,
                                       num_key_value_heads=4, vocab_size=6400),
    # Qwen3-0.6B's shapes: 28 layers, hidden 1024, 16/8 heads of 128, MLP 3072, 151936 tokens, tied
    "Qwen3-0.6B-shaped": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                              head_dim=128, intermediate_size=3072, vocab_size=151936),
}
STATE_COPIES = 4  # weight, gradient, exp_avg, exp_avg_sq: float32 each


def local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * 4


def measure(rank: int, world_size: int, port: int, fsdp: bool, config: dict, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        with torch.device("meta"):
            model = MiniMindForCausalLM(MiniMindConfig(**config))
        block = sum(p.numel() for p in model.model.layers[0].parameters())
        if fsdp:
            shard_model(model, world_size, torch.device("cpu"), torch.bfloat16)
        owned = sum(local_bytes(p) for p in model.parameters()) * STATE_COPIES
        everything = [None] * world_size
        dist.all_gather_object(everything, owned)
        if rank == 0:
            total = sum(p.numel() for p in model.parameters())
            results.put((max(everything), total, block))
    finally:
        dist.destroy_process_group()


def run(world_size: int, fsdp: bool, config: dict) -> tuple[int, int, int]:
    context = mp.get_context("spawn")
    results = context.Queue()
    mp.start_processes(measure, args=(world_size, free_port(), fsdp, config, results), nprocs=world_size,
                       start_method="spawn")
    return results.get()


def gib(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.0f} MiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", default="1,2,4", help="comma-separated process counts")
    options = parser.parse_args(argv)
    counts = [int(n) for n in options.processes.split(",")]
    print("| model | parameters | processes | DDP per rank | FSDP per rank | FSDP / DDP | + gathered block (bf16) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, config in MODELS.items():
        for count in counts:
            ddp, total, block = run(count, False, config)
            fsdp, _, _ = run(count, True, config) if count > 1 else (ddp, total, block)
            print(f"| {name} | {total / 1e6:.0f}M | {count} | {gib(ddp)} | {gib(fsdp)} | {fsdp / ddp:.3f} | "
                  f"{gib(block * 2) if count > 1 else '-'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
