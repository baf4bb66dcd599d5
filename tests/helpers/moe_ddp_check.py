"""Run by tests/trainer/parallel/test_ddp.py as two plain gloo processes (RANK, WORLD_SIZE, MASTER_PORT
in their environment): `moe_ddp_check.py float32|bfloat16`.

A one-layer MoE model (4 experts, top-1) whose router sends a token to expert 0 or 1 by the sign of
one coordinate of its embedding and never to experts 2 and 3: rank 0's tokens all go to expert 0,
rank 1's to experts 0 and 1. Three SGD steps through the trainer's DDP wrapper, which does not look
for unused parameters: an expert that receives no token on a rank (1 on rank 0; 2 and 3 on both)
must still give DDP a gradient there, or the next forward stops with DDP's "Expected to have
finished reduction" error. Rank 0 then takes the same steps in one process on both ranks' batches
(the mean of the two ranks' objectives) and prints one JSON report.
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.tiny_model import tiny_model  # noqa: E402
from trainer.parallel.ddp import wrap_for_distributed  # noqa: E402
from trainer.runtime.distributed import DistContext  # noqa: E402

STEPS = 3
SPLIT = 50  # tokens below go to expert 0, from it on to expert 1


def routed_model() -> torch.nn.Module:
    """The model, its routing fixed by the embeddings' first coordinate (+1 / -1) and a router that
    reads only that coordinate; o_proj zero, so that the MLP's input at the first step is the
    embedding itself (and stays close to it over three small steps)."""
    model = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=1, num_hidden_layers=1).train()
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, 0] = torch.where(torch.arange(embed.shape[0]) < SPLIT, 1.0, -1.0)
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        gate = layer.mlp.gate.weight
        gate.zero_()
        gate[0, 0], gate[1, 0] = 4.0, -4.0
    return model


def batch(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 * step + rank)
    if rank == 0:
        return torch.randint(3, SPLIT, (2, 12), generator=generator)
    return torch.randint(3, 97, (2, 12), generator=generator)


def objective(model, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = model(ids, labels=ids)
    return out.loss + out.aux_loss


def recording(moe, routed: list):
    """`moe._experts`, recording how many tokens each expert receives."""
    experts = moe._experts

    def run(tokens, top_probs, top_experts, weights):
        routed.append(torch.bincount(top_experts.reshape(-1), minlength=moe.num_experts).tolist())
        return experts(tokens, top_probs, top_experts, weights)

    return run


def main(dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    model = routed_model()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    routed = []
    model.model.layers[0].mlp._experts = recording(model.model.layers[0].mlp, routed)
    ddp = wrap_for_distributed(model, DistContext(rank, rank, 2, torch.device("cpu"), "gloo"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        objective(ddp, batch(rank, step), dtype).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finals = [p.detach().clone() for p in model.parameters()]
    other_rank = [torch.zeros_like(p) for p in finals]
    for mine, theirs in zip(finals, other_rank):  # rank 1's parameters to rank 0
        if rank == 1:
            dist.send(mine, 0)
        else:
            dist.recv(theirs, 1)
    all_routed = [None, None]
    dist.all_gather_object(all_routed, routed)
    if rank == 0:
        reference = routed_model()
        sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(STEPS):
            ((objective(reference, batch(0, step), dtype) + objective(reference, batch(1, step), dtype)) / 2).backward()
            sgd.step()
            sgd.zero_grad(set_to_none=True)
        names = [name for name, _ in model.named_parameters()]
        differences = {name: (mine - ref.detach()).abs().max().item()
                       for name, mine, ref in zip(names, finals, reference.parameters())}
        print(json.dumps({
            "routed": all_routed,
            "ranks_equal": all(torch.equal(a, b) for a, b in zip(finals, other_rank)),
            "largest_difference_from_one_process": max(differences.values()),
            "unrouted_experts_unchanged": all(torch.equal(p, initial[name]) for name, p in zip(names, finals)
                                              if ".experts.2." in name or ".experts.3." in name),
            "expert_1_trained": not torch.equal(model.model.layers[0].mlp.experts[1].down_proj.weight,
                                                initial["model.layers.0.mlp.experts.1.down_proj.weight"]),
        }))
        sys.stdout.flush()
    del ddp  # the DDP reducer before its process group (gloo teardown)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
