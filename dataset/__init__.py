"""SFT data pipeline: jsonl chats -> tokens (cached once) -> samples -> sampler -> padded batches.

Every module, in the order of the pipeline, with its one job:

* ``sources``        files, shards, globs, ``.gz`` and ``.parquet`` -> raw lines
* ``formats``        a MiniMind / ShareGPT / OpenAI line -> ``Conversation`` (or ``DataError("file:line: problem")``)
* ``rendering``      a conversation -> text and loss spans through the tokenizer's chat template (any
                     template; the general path), and the tokenizer's loading and fingerprint
* ``prefix_tokens``  the first ``max_seq_len`` tokens of a text without tokenizing all of it
* ``chatml``         the ChatML layout of the shipped and MiniMind's templates, rendered in Python
* ``chatml_encoder`` the fast ChatML encoder: a batch of conversations -> tokens, equal to the general path
* ``pieces``         where the fast encoder may tokenize a text in pieces: proven on token ids per tokenizer
* ``tokens``         THE seam: conversations -> token ids and loss masks; every path calls it
* ``cache``          the token cache (a package): build or reuse a file's cache, then open it
* ``sft_dataset``    ``SFTDataset``: a file's samples (``input_ids``, ``labels``) from its finished cache;
                     ``build_cache_and_open``: build the cache in this process, then open it
* ``packing``        ``PackedSFTDataset``: several whole samples per row
* ``augment``        MiniMind's opt-in augmentations, drawn per (seed, epoch, sample)
* ``mixture``        ``--data_path``'s weighted sources end to end, and which samples each epoch holds
* ``sampler``        ``ResumableDistributedSampler``: a world-size independent, resumable order
* ``epoch_padding``  the samples repeated to pad an epoch to the world size count for nothing
* ``collate``        samples -> a right-padded batch; the batch -> model-inputs contract
* ``tool_calls``     tool calls read back out of generated text (evaluation, chat)
* ``demo_tools``     the demo data's tools and their answers
* ``inspection``     what the data teaches (a package): segments per token, the report, the views
* ``printable``      data text for a terminal: control characters escaped

From ``SFTDataset`` to token ids: ``sft_dataset`` opens the file's finished cache (``cache``) and
builds none. The ids in it were written by ``cache.build`` (a step before: the training script's
data setup, or ``build_cache_and_open``), which parses chunks of lines and calls ``tokens``, the
seam, which calls its encoder (``chatml_encoder`` or ``rendering``): four modules, none passed twice.

The names below are exported here and imported from their module at their first use (PEP 562's
module ``__getattr__``): importing one light module of the package, such as ``printable`` for an
error line, imports no torch.
"""

import importlib

_EXPORTS = {  # name -> the module that defines it
    "ChatAugmenter": "augment",
    "BuildInterrupted": "cache",
    "DataError": "formats",
    "FillerIndex": "epoch_padding",
    "IGNORE_INDEX": "sft_dataset",
    "MarkFillers": "epoch_padding",
    "PackedSFTDataset": "packing",
    "ResumableDistributedSampler": "sampler",
    "SFTCollator": "collate",
    "SFTDataset": "sft_dataset",
    "WorkerDied": "cache",
    "build_cache_and_open": "sft_dataset",
    "encode_conversation": "tokens",
    "load_tokenizer": "rendering",
    "model_inputs": "collate",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """An exported name, imported from its module at its first use and kept here; any other name is a
    missing attribute (and ``from dataset import cache`` imports the module)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
