"""Step 2: seeds, and the RNG state that a resume checkpoint carries for every rank.

Each rank seeds python/numpy/torch with `seed + rank` (dropout masks differ per rank). The data
order does not come from these generators: the sampler has its own seed, the same on all ranks.
States are stored as tensors and plain numbers so `torch.load(weights_only=True)` reads them.
"""

import random

import numpy as np
import torch


def setup_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def capture_rng_state(device: torch.device | None = None) -> dict:
    """This rank's generators: python, numpy, torch's CPU one and, on a GPU, its own device's
    (`cuda`: one state, not every visible GPU's, so a resume on another GPU count restores it)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached_gauss = np.random.get_state()
    return {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gauss": float(cached_gauss)},
        **step_generators(device),
    }


def step_generators(device: torch.device | None = None) -> dict:
    """The generators a training step draws from (dropout): torch's CPU one and, on a GPU, its own
    device's (`cuda`); read on the host, no wait for the device."""
    states = {"torch": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def restore_step_generators(states: dict, device: torch.device | None = None) -> None:
    """Put back what `step_generators` took (or a checkpoint's `capture_rng_state`) on `device`."""
    torch.set_rng_state(states["torch"])
    cuda = cuda_state_for(states.get("cuda"), device)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def restore_rng_state(state: dict, device: torch.device | None = None) -> None:
    """Restore this rank's generators from what `capture_rng_state` saved for the same rank.

    The CUDA state goes to this rank's device; a run on CPU has none to restore. Checkpoints that
    hold a list (every visible GPU's state) give this device's entry, where the list has one."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gauss"]))
    restore_step_generators(state, device)


def cuda_state_for(saved, device: torch.device | None) -> torch.Tensor | None:
    """The saved CUDA generator state that belongs to `device`, or None (no GPU here, none saved,
    or a list of every visible GPU's states without an entry for this device's index)."""
    if saved is None or device is None or device.type != "cuda":
        return None
    if isinstance(saved, torch.Tensor):
        return saved
    index = device.index or 0
    return saved[index] if index < len(saved) else None
