"""The per-device speed settings of the trainer, checked on CPU with a `cuda` device object (no
GPU needed to see which choices are made; tests/test_cuda.py runs them on a GPU)."""

import pytest
import torch

from dataset.rendering import load_tokenizer
from tests.helpers.tiny_model import tiny_model
from trainer import data_setup
from trainer.args import parse_args
from trainer.data_setup import build_eval_sets, build_train_data
from trainer.runtime.distributed import DistContext
from trainer.model_setup import build_optimizer


def context(device: str) -> DistContext:
    return DistContext(rank=0, local_rank=0, world_size=1, device=torch.device(device), backend=None)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_adamw_is_fused_on_every_device_and_decays_matrices_only(device):
    """Fused AdamW everywhere: it takes a non-finite step's skip as a device tensor (`found_inf`)."""
    model = tiny_model()
    args = parse_args(["--weight_decay", "0.1", "--learning_rate", "1e-3"])
    optimizer = build_optimizer(model, args, torch.device(device))
    assert optimizer.defaults["fused"] is True
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])


@pytest.mark.parametrize(("device", "flags", "cpus", "processes", "workers", "pinned"), [
    ("cuda", [], 64, 8, 4, True),                        # GPU: workers prepare batches, pinned memory
    ("cuda", [], 16, 8, 1, True),                        # 2 cores per process: one for the worker
    ("cuda", [], 8, 8, 0, True),                         # 1 core per process: no worker to spare
    ("cuda", ["--num_workers", "3"], 8, 8, 3, True),     # the flag wins
    ("cpu", [], 64, 1, 0, False),                        # CPU: the main process, no pinning
])
@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # the simulated core counts
def test_data_loader_uses_workers_and_pinned_memory_on_cuda(data, tmp_path, monkeypatch, device, flags, cpus,
                                                            processes, workers, pinned):
    monkeypatch.setattr(data_setup, "usable_cpus", lambda: cpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    args = parse_args(["--data_path", str(data / "train.jsonl"), "--cache_dir", str(tmp_path),
                       "--eval_data_path", str(data / "eval.jsonl"), *flags])
    loader = build_train_data(args, load_tokenizer(None), context(device)).loader
    assert loader.num_workers == workers
    assert loader.pin_memory is pinned
    eval_sets = build_eval_sets(args, load_tokenizer(None), context(device), 512)
    assert [eval_set.loader.pin_memory for eval_set in eval_sets] == [pinned]
