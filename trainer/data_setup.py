"""Step 4: tokenizer, SFT dataset (tokenized once, memory-mapped), the resumable distributed
sampler and the DataLoaders."""

import os
import signal
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from dataset import ChatAugmenter, PackedSFTDataset, ResumableDistributedSampler, SFTCollator, SFTDataset


@dataclass
class TrainData:
    dataset: object
    sampler: ResumableDistributedSampler
    loader: DataLoader


def _worker_ignores_preemption(_worker_id: int) -> None:
    # SIGTERM goes to the whole process group; the main process handles it and stops cleanly.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def default_num_workers(args, device: torch.device) -> int:
    """--num_workers if given; on CPU 0 (the cores compute); on CUDA up to 4 per process, from
    the cores this process may use beyond its own (shared by the processes of this node)."""
    if args.num_workers is not None:
        return args.num_workers
    if device.type != "cuda":
        return 0
    processes_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, min(4, usable_cpus() // processes_here - 1))


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def build_dataset(path, args, tokenizer, augmenter=None):
    dataset = SFTDataset(path, tokenizer, args.max_seq_len, bad_data=args.bad_data, cache_dir=args.cache_dir,
                         augmenter=augmenter)
    return PackedSFTDataset(dataset, args.max_seq_len) if args.packing else dataset


def build_train_data(args, tokenizer, ctx) -> TrainData:
    # MiniMind's augmentations (off by default) act on cached samples, drawn per (seed, epoch, index).
    augmenter = ChatAugmenter(tokenizer, args.seed, args.system_prompt_ratio, args.drop_empty_think_ratio)
    dataset = build_dataset(args.data_path, args, tokenizer, augmenter)
    group = bool(args.group_by_length)
    sampler = ResumableDistributedSampler(
        len(dataset), num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed,
        lengths=dataset.lengths if group else None,
        # One group = one optimizer step's global batch: every rank and micro-step gets samples of
        # similar length, and the order stays the same for any split of that batch into
        # processes x micro-batches (so those equivalences and resumes keep holding).
        group_size=args.batch_size * ctx.world_size * args.accumulation_steps if group else None,
    )
    workers = default_num_workers(args, ctx.device)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        collate_fn=SFTCollator(pad_token_id=tokenizer.pad_token_id),
        num_workers=workers,
        pin_memory=ctx.device.type == "cuda",
        # Worker seeds come from this generator, not the global RNG: resuming mid-epoch then
        # leaves the global RNG stream (dropout) exactly where the uninterrupted run had it.
        generator=torch.Generator().manual_seed(args.seed),
        worker_init_fn=_worker_ignores_preemption if workers else None,
    )
    return TrainData(dataset, sampler, loader)


def build_eval_loader(args, tokenizer, ctx) -> DataLoader | None:
    """Each rank evaluates a disjoint slice (no padding duplicates); the loop sums over ranks."""
    if not args.eval_data_path:
        return None
    dataset = build_dataset(args.eval_data_path, args, tokenizer)
    return DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=list(range(ctx.rank, len(dataset), ctx.world_size)),
        collate_fn=SFTCollator(pad_token_id=tokenizer.pad_token_id),
        num_workers=0,
    )
