"""Two real gloo processes show what DDP does with the RoPE buffers (run by test_trainer.py): started
as two processes with RANK, WORLD_SIZE and MASTER_PORT set, each runs one rank; without RANK, it spawns both.

Rank 1 corrupts its copy of `freqs_cos` before wrapping. A plain DDP wrapper broadcasts rank 0's
buffers at construction (and before each forward), overwriting it; the trainer's wrapper, which
ignores `model.freqs_cos`/`model.freqs_sin`, leaves it alone through a forward/backward step,
while the parameters stay in sync (their gradients are still all-reduced), each gradient a view
of DDP's bucket after the all-reduce.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from model import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from trainer.runtime.distributed import DistContext  # noqa: E402
from trainer.parallel.ddp import wrap_for_distributed  # noqa: E402


def tiny_model(rank: int) -> MiniMindForCausalLM:
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64))
    if rank == 1:
        model.model.freqs_cos.fill_(7.0)
    return model


def step(ddp) -> None:
    ids = torch.arange(12).view(2, 6) % 50
    ddp(ids, labels=ids).loss.backward()


def worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    ctx = DistContext(rank, rank, 2, torch.device("cpu"), "gloo")

    plain = DistributedDataParallel(tiny_model(rank))
    step(plain)
    overwritten = bool((plain.module.model.freqs_cos != 7.0).all()) if rank == 1 else None

    ours = wrap_for_distributed(tiny_model(rank), ctx)
    step(ours)
    kept = bool((ours.module.model.freqs_cos == 7.0).all()) if rank == 1 else None
    storages = {p.grad.untyped_storage().data_ptr() for p in ours.parameters()}
    grads = ours.module.lm_head.weight.grad.clone()
    gathered = [torch.zeros_like(grads) for _ in range(2)]
    dist.all_gather(gathered, grads)
    if rank == 1:
        print("ignored:", sorted(ours.parameters_to_ignore))
        if overwritten:
            print("without ignore: rank 1 buffer overwritten by rank 0")
        if kept:
            print("with ignore: rank 1 buffer kept")
        print(f"gradients: {len(list(ours.parameters()))} parameters in {len(storages)} bucket(s)")
        assert torch.equal(gathered[0], gathered[1]), "parameter gradients must still be all-reduced"
        sys.stdout.flush()
    del plain, ours  # free the DDP reducers before their process group (gloo teardown deadlock)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__" and "RANK" in os.environ:  # one rank of the two, started apart (MASTER_PORT given)
    worker(int(os.environ["RANK"]), int(os.environ["MASTER_PORT"]))
elif __name__ == "__main__":
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    mp.spawn(worker, args=(free,), nprocs=2, join=True)
