"""The fault tests' run lengths, and what they check a run's save_dir and output with."""

import hashlib
import os

import torch

from trainer.checkpoint.resume import load_resume_checkpoint


# One process x batch 4, and two processes x batch 2: 10 optimizer steps, a checkpoint every 2.
ONE_PROCESS = ["--batch_size", "4", "--max_steps", "10", "--save_interval", "2", "--keep_last", "10"]
TWO_PROCESSES = ["--batch_size", "2", "--max_steps", "10", "--save_interval", "2", "--keep_last", "10"]
FINAL_STEP = 10


def checkpoint_names(save_dir) -> list[str]:
    folder = os.path.join(save_dir, "checkpoints")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def temporaries(save_dir) -> list[str]:
    return [name for name in checkpoint_names(save_dir) if ".tmp." in name]


def digest(path) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


class CheckpointWatcher:
    """Records the bytes of every complete checkpoint as soon as it appears (they are renamed into
    place whole), to prove afterwards that no fault damaged them."""

    def __init__(self, save_dir):
        self.save_dir = save_dir
        self.seen: dict[str, str] = {}

    def poll(self) -> int:
        for name in checkpoint_names(self.save_dir):
            if name.endswith(".pt") and name not in self.seen:
                self.seen[name] = digest(os.path.join(self.save_dir, "checkpoints", name))
        return len(self.seen)

    def assert_undamaged(self) -> None:
        assert self.seen, "no checkpoint existed before the fault"
        for name, before in self.seen.items():
            path = os.path.join(self.save_dir, "checkpoints", name)
            assert digest(path) == before, f"{name} changed"
            assert load_resume_checkpoint(path)["step"] == int(name[5:13])


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def all_finite(state) -> bool:
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(all_finite(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return all(all_finite(value) for value in state)
    return True
