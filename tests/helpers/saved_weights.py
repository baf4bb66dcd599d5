"""Which weights the tensors saved for the backward hold copies of (tests of model/compute_weights.py)."""

import torch


def saved_by(run) -> tuple[object, list[torch.Tensor]]:
    """`run()`'s result and every tensor autograd saved for the backward while it ran."""
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return result, saved


def weight_copies(saved: list[torch.Tensor], weights: dict[str, torch.Tensor], parameters) -> list[str]:
    """The names of `weights` whose values (all of a weight's rows, one after the other) lie in the
    allocated memory of a saved tensor that is not one of `parameters`' own."""
    own = {p.untyped_storage().data_ptr() for p in parameters}
    found = set()
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in own:
            continue
        memory = torch.tensor([], dtype=tensor.dtype).set_(storage)
        for name, weight in weights.items():
            values = weight.reshape(-1)
            if weight.dtype == tensor.dtype and memory.numel() >= values.numel():
                windows = memory.unfold(0, values.numel(), weight.shape[-1])
                if (windows == values).all(dim=1).any():
                    found.add(name)
    return sorted(found)


def saved_parameters(saved: list[torch.Tensor], named_parameters) -> list[str]:
    """The names of the parameters whose memory some saved tensor is (or views)."""
    storages = {tensor.untyped_storage().data_ptr() for tensor in saved}
    return sorted(name for name, p in named_parameters if p.untyped_storage().data_ptr() in storages)
