"""SFT data pipeline: jsonl chats -> token cache -> samples -> sampler -> padded batches.

1. ``formats`` parses MiniMind / ShareGPT / OpenAI jsonl lines (tools, tool calls, tool results,
   reasoning) into a ``Conversation`` and reports bad lines as ``DataError("file:line: problem")``
   (or skips them); nothing the data carries is dropped silently.
2. ``rendering`` renders each chat (with its tools) through the tokenizer's chat template,
   locates every assistant turn's loss span in that one rendering and maps it to tokens by
   offsets (works for any HF template, prefix-stable or not); ``tool_calls`` reads tool calls
   back out of generated text; ``augment`` holds MiniMind's opt-in augmentations.
3. ``token_cache`` tokenizes the file once, in parallel on every core, into a memory-mapped
   cache keyed by the data, tokenizer, template and ``max_seq_len`` (``fast_path``: ChatML
   templates rendered in Python by ``chatml``, a chunk tokenized at once; ``team_build``: the
   local ranks of a node build it together under torch.distributed).
4. ``SFTDataset`` / ``PackedSFTDataset`` serve ``input_ids`` / ``labels`` (and ``position_ids``
   for packed rows) from the cache; ``ResumableDistributedSampler`` shards a world-size
   independent global order that can resume at any global sample offset; ``SFTCollator``
   right-pads a batch to its longest item; ``epoch_padding``: the samples repeated only to pad an
   epoch to a multiple of the world size count for nothing.
5. ``mixture`` reads ``--data_path`` (several weighted sources: files, directories of shards,
   globs), lays the sources end to end (``MixtureDataset``, items tagged with their ``source``)
   and says which samples each epoch holds (``EpochMixture``), for the sampler to shuffle.
"""

from .augment import ChatAugmenter
from .collate import SFTCollator, model_inputs, pad_fraction
from .epoch_padding import FillerIndex, MarkFillers
from .formats import DataError
from .rendering import encode_conversation, load_tokenizer
from .sampler import ResumableDistributedSampler
from .token_cache import BuildInterrupted
from .sft_dataset import IGNORE_INDEX, PackedSFTDataset, SFTDataset, pack_lengths
from .worker_pool import WorkerDied

__all__ = [
    "ChatAugmenter",
    "BuildInterrupted",
    "DataError",
    "FillerIndex",
    "IGNORE_INDEX",
    "MarkFillers",
    "PackedSFTDataset",
    "ResumableDistributedSampler",
    "SFTCollator",
    "SFTDataset",
    "WorkerDied",
    "encode_conversation",
    "load_tokenizer",
    "model_inputs",
    "pack_lengths",
    "pad_fraction",
]
