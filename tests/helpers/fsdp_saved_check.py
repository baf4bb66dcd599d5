"""Run by tests/model/test_compute_weights.py under torchrun (2 processes, gloo): `--fsdp 1
--dtype bfloat16`'s sharding (FSDP2, bf16 parameters under autocast) of a tiny dense and a tiny MoE
model, one forward each. Rank 0 prints one JSON object: per model, the block weights whose values
a tensor saved for the backward still holds after the forward, and how many saved tensors FSDP
freed (the block's parameters, resharded after its forward)."""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.saved_weights import saved_by, weight_copies  # noqa: E402
from tests.helpers.tiny_model import tiny_model  # noqa: E402
from trainer.parallel.fsdp import shard_model  # noqa: E402
from trainer.runtime.groups import close_process_groups  # noqa: E402
from trainer.runtime.precision import autocast  # noqa: E402


def check(use_moe: bool) -> dict:
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    model = tiny_model(use_moe=use_moe, num_experts=4, num_experts_per_tok=2).train()
    weights = {name: p.detach().to(bf16) for name, p in model.named_parameters() if ".layers." in name and p.dim() == 2}
    model = shard_model(model, dist.get_world_size(), cpu, bf16)
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    with autocast(cpu, bf16):
        out, saved = saved_by(lambda: model(ids, labels=ids, skip_logits=True))
    report = {"copies": weight_copies(saved, weights, ()),
              "freed": sum(tensor.untyped_storage().nbytes() == 0 for tensor in saved)}
    (out.loss + (out.aux_loss if use_moe else 0)).backward()
    return report


if __name__ == "__main__":
    dist.init_process_group("gloo")
    reports = {kind: check(kind == "moe") for kind in ("dense", "moe")}
    if dist.get_rank() == 0:
        print(json.dumps(reports), flush=True)
    close_process_groups()
