"""Batch collation with right padding, and the batch -> model-inputs contract."""

from __future__ import annotations

import numpy as np
import torch

from model.loss import IGNORE_INDEX, loss_positions_of
from model.packed_attention import PackedDocuments, document_starts


class SFTCollator:
    """Right-pad a list of dataset items into a batch of long tensors.

    The batch length is the longest item, rounded up to ``pad_to_multiple_of`` if given but never
    past ``max_length`` (the longest item a dataset gives, which the model's positions take), or
    exactly ``pad_to_length`` if given (MiniMind's pad-to-max baseline). Returns ``input_ids``
    (pads: ``pad_token_id``), ``labels`` (pads: -100), ``attention_mask`` (1 real, 0 pad) and,
    when the items have them (packed rows), ``position_ids`` (pads: 0), all ``[B, T]`` long.
    An item flagged ``filler`` (it only pads an epoch's end, see epoch_padding.py) keeps its tokens
    but gets no labels and an attention mask of 0: its row counts for nothing.

    Also what the model would otherwise compute on its device, each a host sync on a GPU
    (see model/modeling_minimind.py): ``loss_positions`` (flat indices of the tokens whose next
    token has a label) and, for packed rows, ``packed_layout`` (a CPU ``PackedDocuments``; the
    trainer's ``model_inputs`` moves it to the device with the tensors).

    Items of a mixture (``dataset.mixture.MixtureDataset``) carry their ``source``: the batch then
    has ``source_ids`` ``[B]`` and ``loss_sources`` (the source of every loss position, aligned
    with ``loss_positions``), for the per-source losses.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None, pad_to_length: int | None = None,
                 max_length: int | None = None):
        if pad_token_id is None:
            raise ValueError("pad_token_id is required")
        if pad_to_multiple_of is not None and pad_to_length is not None:
            raise ValueError("pass pad_to_multiple_of or pad_to_length, not both")
        if pad_to_multiple_of and max_length is None:
            raise ValueError("pad_to_multiple_of needs max_length, the length no batch is padded past")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_to_length = pad_to_length
        self.max_length = max_length

    def batch_length(self, longest: int) -> int:
        if self.pad_to_length is not None:
            if longest > self.pad_to_length:
                raise ValueError(f"an item of {longest} tokens is longer than pad_to_length={self.pad_to_length}")
            return self.pad_to_length
        if self.pad_to_multiple_of:
            rounded = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
            return max(longest, min(rounded, self.max_length))
        return longest

    def __call__(self, items: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        length = self.batch_length(max(len(item["input_ids"]) for item in items))
        has_positions = all("position_ids" in item for item in items)
        batch = {
            "input_ids": torch.full((len(items), length), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((len(items), length), IGNORE_INDEX, dtype=torch.long),
            "attention_mask": torch.zeros((len(items), length), dtype=torch.long),
        }
        if has_positions:
            batch["position_ids"] = torch.zeros((len(items), length), dtype=torch.long)
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            batch["input_ids"][row, :n] = torch.as_tensor(item["input_ids"], dtype=torch.long)
            if not item.get("filler"):
                batch["labels"][row, :n] = torch.as_tensor(item["labels"], dtype=torch.long)
                batch["attention_mask"][row, :n] = 1
            if has_positions:
                batch["position_ids"][row, :n] = torch.as_tensor(item["position_ids"], dtype=torch.long)
        batch["loss_positions"] = loss_positions_of(batch["labels"])
        if all("source" in item for item in items):
            batch["source_ids"] = torch.as_tensor([item["source"] for item in items], dtype=torch.long)
            batch["loss_sources"] = batch["source_ids"][batch["loss_positions"] // length]
        if has_positions:
            starts, lengths = document_starts(batch["position_ids"])
            batch["packed_layout"] = PackedDocuments(starts, lengths, batch["position_ids"].shape)
        return batch


def model_inputs(batch: dict, device: torch.device) -> dict:
    """The batch -> model-inputs contract, for training and evaluation alike. Right padding + causal
    attention: real tokens never see the pads, so no attention mask is needed (and SDPA keeps its
    fused causal kernel); `token_mask` only tells the MoE balance loss which tokens are real. Packed
    rows carry position_ids. The collator's precomputed `loss_positions` / `packed_layout` spare the
    model host syncs (see model/modeling_minimind.py); every copy is asynchronous."""
    inputs = {key: batch[key].to(device, non_blocking=True)
              for key in ("input_ids", "labels", "position_ids", "loss_positions", "packed_layout") if key in batch}
    if "attention_mask" in batch:
        inputs["token_mask"] = batch["attention_mask"].to(device, non_blocking=True)
    return inputs
