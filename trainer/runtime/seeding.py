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


def capture_rng_state() -> dict:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached_gauss = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gauss": float(cached_gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict, cuda_device_count: int | None = None) -> str | None:
    """Restore this rank's generators. Returns a note when the CUDA states cannot be restored
    (the checkpoint saw another number of CUDA devices than this process does): GPU randomness
    such as dropout then continues from this run's seeds, so the resume is not bit-identical."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" not in state:
        return None
    if cuda_device_count is None:
        cuda_device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda_states = state["cuda"]
    if len(cuda_states) != cuda_device_count:
        return (f"the checkpoint holds CUDA RNG states of {len(cuda_states)} visible device(s), this process sees "
                f"{cuda_device_count}: they are not restored, so GPU randomness (dropout) continues from this "
                "run's seeds and the resume is not bit-identical")
    torch.cuda.set_rng_state_all(cuda_states)
    return None
