"""Per-rank memory of weights + gradients + AdamW state under DDP and under FSDP2 (`--fsdp 1`):
computed from the shapes, and measured after a real optimizer step.

    python scripts/bench_memory.py                          # both models, 1, 2 and 4 processes (CPU)
    python scripts/bench_memory.py --models minisft --processes 1,2,4,8
    python scripts/bench_memory.py --device cuda            # one GPU per process, NCCL

For each model (the trainer's default MiniMind and a Qwen3-0.6B-shaped one, random weights) and
each process count N, N real processes (gloo on CPU, NCCL on CUDA):

1. build the model on the meta device (no memory) and wrap it as the trainer does (trainer/parallel/fsdp.py
   for FSDP: every block and the root fully_shard-ed; DDP keeps the whole model). "computed": the
   bytes of the weights a rank owns x 4 (weight, gradient, AdamW's two moments; all float32).
2. allocate and initialise what the rank owns (`to_empty`: under FSDP only its shards), take one
   real optimizer step with the trainer's `optimizer_step` (`trainer/loop/loop.py`; one row of 64 random tokens,
   float32, clipping) and, right after AdamW's update while the gradients still exist, add up the
   storages behind the parameters, their gradients and the optimizer state (`held_bytes`: a
   DTensor counts its local shard with FSDP's padding, a storage shared by several tensors counts
   once, AdamW's step counters count too): "measured". On CUDA also
   `torch.cuda.max_memory_allocated` over the step ("CUDA peak": this adds the activations, the
   all-gathered blocks under FSDP and DDP's gradient buckets).

Each figure is the largest rank's (FSDP pads a dimension that N does not divide onto the first
ranks). A row whose processes would need more RAM than the machine has available (DDP of the
0.6B model holds ~9 GiB per process) is not measured, and the table says so. Not counted in
"computed" and "measured": activations, and under FSDP the one block whose full weights are
all-gathered while it runs (its parameters in bf16, 2 bytes each, shown as "+ gathered block (bf16)").
"""

import gc
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dataset import SFTCollator  # noqa: E402
from model import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from model.rope import precompute_rope_tables  # noqa: E402
from scripts._common import ArgumentParser, run_main  # noqa: E402
from trainer.runtime.distributed import all_gather_objects, DistContext, free_port  # noqa: E402
from trainer.runtime.groups import close_process_groups  # noqa: E402
from trainer.parallel.fsdp import FullyShardedParallel  # noqa: E402
from trainer.loop.loop import agree_on_step, optimizer_step  # noqa: E402
from trainer.loop.state import Run  # noqa: E402
from trainer.model_setup import build_optimizer  # noqa: E402
from trainer.runtime.precision import build_grad_scaler  # noqa: E402
from trainer.parallel.ddp import Replicated  # noqa: E402

MODELS = {
    # the trainer's defaults (--hidden_size 768 --num_hidden_layers 8, the shipped 6400-token vocabulary)
    "minisft": ("minisft default (768 x 8)", dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=8,
                                                  num_key_value_heads=4, vocab_size=6400)),
    # Qwen3-0.6B's shapes: 28 layers, hidden 1024, 16/8 heads of 128, MLP 3072, 151936 tokens, tied
    "qwen3-0.6b": ("Qwen3-0.6B-shaped", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                             num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                             vocab_size=151936)),
}
STATE_COPIES = 4  # weight, gradient, exp_avg, exp_avg_sq: float32 each
STEP_TOKENS = 64
PROCESS_OVERHEAD = 2**30  # RAM a process needs beyond the state: Python, torch, activations of one short row


def local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * 4


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this process holds for the model's parameters, their gradients and the optimizer's
    state tensors: the storages behind them (a DTensor's local shard), each storage counted once."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        storages[(local.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


@torch.no_grad()
def materialise(model: MiniMindForCausalLM, device: torch.device) -> None:
    """Allocate the (local shards of the) meta-device model and give it random weights, norms at 1
    and its RoPE tables. The tied lm_head stays the embedding (to_empty gives every module a tensor of
    its own; FSDP keeps one sharded parameter for the two)."""
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    model.to_empty(device=device)
    if tied and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight = model.model.embed_tokens.weight
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        if parameter.dim() >= 2:
            local.normal_(0.0, model.config.initializer_range)
        else:
            local.fill_(1.0)
    cos, sin = precompute_rope_tables(model.config, device=device)
    model.model.freqs_cos.copy_(cos)
    model.model.freqs_sin.copy_(sin)


def one_step_batch(vocab_size: int) -> dict:
    ids = torch.randint(1, vocab_size, (STEP_TOKENS,), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[: STEP_TOKENS // 4] = -100  # a prompt without loss
    return SFTCollator(pad_token_id=0)([{"input_ids": ids.numpy(), "labels": labels.numpy()}])


def measure_after_step(parallel, model, wrapped, ctx) -> tuple[int, int | None]:
    """(held_bytes right after AdamW's update of one trainer optimizer step, the CUDA allocator's peak
    over that step or None on CPU)."""
    args = SimpleNamespace(grad_clip=1.0, learning_rate=1e-4, weight_decay=0.1, save_dir="-")
    optimizer = build_optimizer(model, args, ctx.device)
    run = Run(args, ctx, wrapped, optimizer, build_grad_scaler(ctx.device, torch.float32), torch.float32, data=None,
              eval_sets=[], tokenizer=None, logger=None, preemption=SimpleNamespace(requested=False), parallel=parallel)
    held = []
    optimizer.register_step_post_hook(lambda *_: held.append(held_bytes(model, optimizer)))
    batches = [one_step_batch(model.config.vocab_size)]
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    optimizer_step(run, batches, agree_on_step(run, batches), args.learning_rate)
    if not held:
        raise RuntimeError("the measuring step was skipped (non-finite gradient norm)")
    return held[0], torch.cuda.max_memory_allocated(ctx.device) if cuda else None


def rank_figures(ctx, fsdp: bool, config: dict, measure: bool) -> tuple:
    """This rank's (parameters, parameters of one block, computed, measured, CUDA peak). Everything
    it builds is freed when it returns: a DDP wrapper must go while its process group is alive (see
    train_full_sft.py, step 9)."""
    torch.manual_seed(ctx.rank)
    with torch.device("meta"):
        model = MiniMindForCausalLM(MiniMindConfig(**config))
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    parallel = FullyShardedParallel(ctx, torch.float32) if fsdp else Replicated(ctx)
    wrapped = parallel.wrap(model) if fsdp else None  # FSDP shards the meta model in place
    computed = sum(local_bytes(p) for p in model.parameters()) * STATE_COPIES
    measured = peak = None
    if measure:
        materialise(model, ctx.device)
        if not fsdp:
            wrapped = parallel.wrap(model)  # DDP (one process: the model itself) on the real weights
        measured, peak = measure_after_step(parallel, model, wrapped, ctx)
    return total, block, computed, measured, peak


def worker(rank: int, world_size: int, port: int, fsdp: bool, config: dict, device_type: str, measure: bool,
           results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        ctx = DistContext(rank=rank, local_rank=rank, world_size=world_size, device=device, backend=backend)
        figures = all_gather_objects(rank_figures(ctx, fsdp, config, measure))
        gc.collect()  # the model and its wrapper, before the process group goes
        if rank == 0:
            total, block = figures[0][:2]
            largest = [None if None in column else max(column) for column in list(zip(*figures))[2:]]
            results.put((total, block, *largest))
    finally:
        close_process_groups()


def run(world_size: int, fsdp: bool, config: dict, device_type: str = "cpu", measure: bool = True) -> tuple:
    """(parameters, parameters of one block, computed, measured, CUDA peak) per rank, the largest rank's."""
    context = mp.get_context("spawn")
    results = context.Queue()
    mp.start_processes(worker, args=(world_size, free_port(), fsdp, config, device_type, measure, results),
                       nprocs=world_size, start_method="spawn")
    return results.get()


def available_ram(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        with open(meminfo, encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def ram_needed(world_size: int, fsdp: bool, config: dict) -> int:
    """A generous estimate of the RAM N CPU processes need for the measuring step: the state (DDP
    also keeps a flat copy of the gradients for its all-reduce buckets), under FSDP twice the
    largest all-gathered unit (the root's embedding, or a block: weights and gradients unsharded),
    and a fixed allowance for Python, torch and the activations of one short row."""
    with torch.device("meta"):
        model = MiniMindForCausalLM(MiniMindConfig(**config))
    parameters = sum(p.numel() for p in model.parameters())
    if not fsdp:
        return world_size * (parameters * 4 * (STATE_COPIES + 1) + PROCESS_OVERHEAD)
    largest = max(model.model.embed_tokens.weight.numel(), sum(p.numel() for p in model.model.layers[0].parameters()))
    return world_size * (parameters * 4 * STATE_COPIES // world_size + 2 * largest * 4 + PROCESS_OVERHEAD)


def fits_in_ram(world_size: int, fsdp: bool, config: dict, device_type: str) -> bool:
    """Whether N CPU processes fit in the RAM available now (on CUDA each GPU's memory is its own business)."""
    available = available_ram()
    return device_type == "cuda" or available is None or ram_needed(world_size, fsdp, config) < available


def size(count: int | None) -> str:
    if count is None:
        return "not measured (RAM)"
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.0f} MiB"


def table_rows(name: str, config: dict, count: int, device_type: str) -> str:
    ddp = run(count, False, config, device_type, fits_in_ram(count, False, config, device_type))
    fsdp = run(count, True, config, device_type, fits_in_ram(count, True, config, device_type)) if count > 1 else ddp
    total, block = ddp[0], ddp[1]
    ddp_held = ddp[3] or ddp[2]  # DDP not measured (RAM): its computed figure (a whole copy on every rank)
    ratio = f"{fsdp[3] / ddp_held:.3f}" if fsdp[3] else "-"
    cells = [name, f"{total / 1e6:.0f}M", str(count), size(ddp[2]), size(ddp[3]), size(fsdp[2]), size(fsdp[3]), ratio,
             size(block * 2) if count > 1 else "-"]
    if device_type == "cuda":
        cells += [size(ddp[4]), size(fsdp[4])]
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--processes", default="1,2,4", help="comma-separated process counts")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: one GPU per process (NCCL) and the allocator's peak over the step")
    options = parser.parse_args(argv)
    try:
        counts = [int(n) for n in options.processes.split(",")]
    except ValueError:
        parser.error(f"--processes {options.processes}: expected process counts like 1,2,4")
    if min(counts) < 1:
        parser.error(f"--processes {options.processes}: every count must be 1 or more")
    unknown = [key for key in options.models.split(",") if key not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    models = [MODELS[key] for key in options.models.split(",")]
    if options.device == "cuda" and max(counts) > torch.cuda.device_count():
        parser.error(f"--device cuda --processes {options.processes} needs {max(counts)} GPUs; "
                     f"this machine has {torch.cuda.device_count()}")
    header = ["model", "parameters", "processes", "DDP computed", "DDP measured", "FSDP computed", "FSDP measured",
              "FSDP measured / DDP", "+ gathered block (bf16)"]
    if options.device == "cuda":
        header += ["DDP CUDA peak", "FSDP CUDA peak"]
    print("| " + " | ".join(header) + " |")
    print("| --- | " + " | ".join("---:" for _ in header[1:]) + " |")
    for name, config in models:
        for count in counts:
            print(table_rows(name, config, count, options.device), flush=True)
    return 0


if __name__ == "__main__":
    run_main(main)
