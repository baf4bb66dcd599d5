"""`--fsdp 1`: sharded data parallelism with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each transformer block and the root module are sharded over all processes: a rank keeps 1/N of
every weight, gradient and AdamW state in float32. A block's full weights exist only while it runs
(all-gathered before its forward and again for its backward, in `--dtype`), and its gradients are
reduce-scattered in float32 at the end of its backward, on every micro-batch: with
`--accumulation_steps` above 1 the micro-batches add up in the sharded gradients, so no rank holds
the whole model's gradients (at the cost of one reduce-scatter per micro-batch, not one per step).

The mathematics is DDP's: FSDP2's reduce-scatter averages over the ranks exactly as DDP's
all-reduce does, so the loop's `x world_size` gives the same token-mean gradient under both
(tests/trainer/parallel/test_fsdp.py checks FSDP against one process and against DDP).
"""

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from model import MiniMindForCausalLM
from trainer.checkpoint import sharded
from trainer.checkpoint.background import host_model
from trainer.weights.read import LM_HEAD


def mixed_precision(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """Compute in `dtype` (the all-gathered weights); master weights, gradient reduction and the
    optimizer stay in float32."""
    return MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)


def shard_model(model: MiniMindForCausalLM, world_size: int, device: torch.device, dtype: torch.dtype):
    """fully_shard every decoder block, then the root (embeddings, final norm, lm_head).

    Rank 0's initial weights first go to every rank (as DDP does when it wraps): each rank seeds
    with seed + rank, and fully_shard keeps whatever slice of its own tensors a rank holds."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if not tensor.is_meta:  # a meta-device model (scripts/bench_memory.py) has no values
                dist.broadcast(tensor, src=0)
    mesh = init_device_mesh(device.type, (world_size,))
    policy = mixed_precision(dtype)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


class FullyShardedParallel:
    """The `trainer.parallel.Parallelism` interface for a fully_shard-ed model."""

    checkpoint_kind = "sharded"

    def __init__(self, ctx, dtype: torch.dtype):
        self.ctx, self.dtype = ctx, dtype
        self.model = None

    def wrap(self, model):
        self.model = shard_model(model, self.ctx.world_size, self.ctx.device, self.dtype)
        return self.model

    def micro_step(self, model, last: bool):
        """Every micro-batch reduce-scatters (FSDP2's default): each block's gradients are
        reduce-scattered as its backward ends and added to the rank's float32 shard, so between
        micro-batches a rank holds 1/N of them. `set_requires_gradient_sync(False)` (DDP's `no_sync`)
        would communicate once per step but hold every parameter's whole float32 gradient on every
        rank until then: the memory sharding is there to save."""
        return contextlib.nullcontext()

    def settle_layout(self, backward_of_zero) -> None:
        """Nothing: FSDP2's reduce-scatter layout is fixed when the model is sharded."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global norm over all shards (one all-reduce), then every shard scaled by the same factor."""
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
        return norm

    def training_state(self, optimizer) -> dict:
        """The model's and the optimizer's shards, the optimizer left as it is. An optimizer that has not
        stepped has no state, and torch's `get_state_dict` makes the state it returns by a step of zero
        gradients at learning rate 0 (`_init_optim_state`): AdamW's counter would then say 1, and the
        first real update would be bias-corrected as a second one (x0.73 at betas 0.9, 0.95). So that
        state is taken off the optimizer again, and the checkpoint's counters say 0: the state AdamW
        starts its first step from."""
        unstepped = not optimizer.state
        model_state, optimizer_state = get_state_dict(self.model, optimizer)
        if unstepped:
            optimizer.state.clear()
            for state in optimizer_state["state"].values():
                if "step" in state:
                    state["step"] = torch.zeros_like(state["step"])
        return {"model": model_state, "optimizer": optimizer_state}

    def load_training_state(self, optimizer, saved: dict) -> None:
        if sharded.is_sharded(saved):
            sharded.load_training_state(self.model, optimizer, saved)
            return
        # A DDP / single-process file: full tensors on every rank; each rank keeps its shard.
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, saved["model"], options=full)
        set_optimizer_state_dict(self.model, optimizer, optimizer_state_by_name(self.model, optimizer, saved["optimizer"]),
                                 options=full)

    def write_resume_checkpoint(self, content: dict, save_dir: str, keep_last: int) -> sharded.ShardedSave:
        return sharded.start_save(content, save_dir, keep_last, self.ctx)

    def inference_model(self, dtype: torch.dtype):
        return gather_to_rank0(self.model, self.ctx.is_main, dtype)


def optimizer_state_by_name(model, optimizer, state: dict) -> dict:
    """`optimizer.state_dict()` numbers parameters in param-group order; the sharded loader wants
    their names. `build_optimizer` puts them in the same order in every run, so position i of
    group g here is position i of group g in the saved state."""
    names = {param: name for name, param in model.named_parameters()}
    groups, by_name = [], {}
    for saved_group, group in zip(state["param_groups"], optimizer.param_groups, strict=True):
        ids, params = saved_group["params"], group["params"]
        if len(ids) != len(params):
            raise ValueError(f"optimizer group has {len(ids)} parameters in the checkpoint, {len(params)} here")
        for number, param in zip(ids, params):
            if number in state["state"]:
                by_name[names[param]] = state["state"][number]
        groups.append({**saved_group, "params": [names[param] for param in params]})
    return {"state": by_name, "param_groups": groups}


@torch.no_grad()
def gather_to_rank0(model, is_main: bool, dtype: torch.dtype):
    """A plain model on rank 0 with the full weights in `dtype` (`--save_dtype`), tensor by tensor
    (collective).

    Rank 0 never holds more than the weights of the final file plus the one float32 tensor being
    gathered: each sharded tensor is all-gathered, cast, moved to the CPU and assigned into a model
    built on the meta device (which has no memory of its own). A tied `lm_head.weight` is the
    embedding: not gathered and copied a second time (`host_model` ties it)."""
    gathered = {}
    tied = model.config.tie_word_embeddings
    for name, value in model.state_dict().items():
        if tied and name == LM_HEAD:
            continue
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if is_main:
            gathered[name] = value.detach().to(device="cpu", dtype=dtype, copy=True)
        del value
    if not is_main:
        return None
    return host_model(model.config, gathered, model)
