"""Step 4: the token caches of every data file (built or reused: ``build_token_caches``), then the
SFT dataset over them (memory-mapped; several weighted sources with `dataset.mixture`), the
resumable distributed sampler and the DataLoaders, the run's identity (trainer/run_identity.py)
from the data just opened, and the held-out sets."""

import fnmatch
import math
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from dataset import ChatAugmenter, MarkFillers, PackedSFTDataset, ResumableDistributedSampler, SFTCollator, SFTDataset
from dataset.cache import build_or_reuse_on_node, default_cache_root, measurement_key
from dataset.formats import DataError
from dataset.inspection.report import training_summary
from dataset.mixture import ConcatenatedSamples, EpochMixture, MixtureDataset, lone_weight_note, parse_data_path
from dataset.printable import print_escaped
from dataset.sources import check_data_file
from trainer.args import held_out_files
from trainer.checkpoint.save_dir import METRICS_FILE
from trainer.errors import ConfigError
from trainer.evaluation.evaluate import EvalSet, generation_examples, long_prompts, no_room_problem
from trainer.evaluation.selection import eval_set_names
from trainer.model_setup import COMPILE_PAD_MULTIPLE
from trainer.run_identity import RunIdentity, epoch_grouping, identify_run


@dataclass
class TrainData:
    dataset: MixtureDataset
    sampler: ResumableDistributedSampler
    loader: DataLoader
    identity: RunIdentity  # what defines the sample stream, from the data opened here
    source_names: list[str] = field(default_factory=lambda: ["data"])  # of --data_path's sources, in order


def check_data_files(args, log=print) -> list:
    """--data_path's sources, parsed (`parse_data_path`) for `build_train_data`. Every source resolves
    (files, directories, globs, weights) and every held-out file passes `check_data_file` (missing,
    empty, a folder, ...): a one-line DataError before a previous run is set aside (--overwrite 1) or
    any data is tokenized. The training files themselves, maybe thousands of shards, are checked as
    their caches are built. A held-out file that is also trained on is said (`log`): its figures measure
    what the model learned of it. A held-out file named twice is refused: it would count twice in
    eval_loss."""
    sources = parse_data_path(args.data_path)
    trained = {os.path.realpath(path) for source in sources for path in source.files}
    for source in sources:
        if reads_run_log(source.spec, args.save_dir):
            raise DataError(f"--save_dir {args.save_dir} is where --data_path {source.spec} reads its files: the run's "
                            "metrics.jsonl would be read as data on resume; choose another --save_dir")
    held_out: dict[str, str] = {}  # real path -> as first given
    for path in held_out_files(args.eval_data_path):
        check_data_file(Path(path))
        real = os.path.realpath(path)
        if real in held_out:
            first = held_out[real]
            named = f"{path} twice" if first == path else f"{first} twice (as {first} and {path})"
            raise DataError(f"--eval_data_path names {named}: it would be evaluated twice and count twice in "
                            "eval_loss; give it once")
        held_out[real] = path
        if real in trained:
            log(f"[eval] warning: {path} is held out and also trained on (--data_path): its evaluation measures "
                "what the model learned of it, not how it does on conversations it has not seen")
    return sources


def reads_run_log(spec: str, save_dir: str) -> bool:
    """Whether the data source `spec` (a directory, or a glob over one folder) would read the
    `metrics.jsonl` a run writes in `save_dir`."""
    folder, pattern = (spec, "*.jsonl") if os.path.isdir(spec) else os.path.split(spec)
    return os.path.realpath(folder or ".") == os.path.realpath(save_dir) and fnmatch.fnmatch(METRICS_FILE, pattern)


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


def build_token_caches(paths, args, tokenizer, local_rank: int) -> None:
    """The token cache of each of these data files, built where missing (or continued), by local
    rank 0 of each node under torch.distributed (dataset.cache.build_or_reuse_on_node); the
    datasets opened after this step find them finished. A cache beside the data that cannot be written
    there (a read-only mount) is one line that names --cache_dir, the way out."""
    for path in map(Path, paths):
        cache_root = default_cache_root(path, args.cache_dir)
        try:
            build_or_reuse_on_node(path, tokenizer, args.max_seq_len, cache_root, args.bad_data, local_rank=local_rank)
        except OSError as error:
            failed = Path(error.filename) if error.filename else None
            if args.cache_dir or failed is None or not (failed == cache_root or cache_root in failed.parents):
                raise
            raise DataError(f"{failed}: {error.strerror or error}; give --cache_dir DIR for the token cache of "
                            f"{path.name}") from error


def open_samples(path, args, tokenizer, augmenter=None, log=print) -> SFTDataset:
    """One data file's samples, from its finished token cache (``build_token_caches``)."""
    return SFTDataset(path, tokenizer, args.max_seq_len, bad_data=args.bad_data, cache_dir=args.cache_dir,
                      augmenter=augmenter, log=log)


def build_dataset(path, args, tokenizer, augmenter=None, log=print):
    dataset = open_samples(path, args, tokenizer, augmenter, log)
    return PackedSFTDataset(dataset, args.max_seq_len) if args.packing else dataset


def build_mixture(args, sources: list, tokenizer, augmenter, log) -> tuple[MixtureDataset, EpochMixture, list]:
    """The `sources` of --data_path end to end (one token cache per file; with --packing 1 each
    source is packed into rows of its own), the epoch's counts per source, and each source with
    the datasets of its files."""
    parts, opened, first_index = [], [], 0
    for source in sources:
        files = []
        opened.append((source, files))
        for path in source.files:
            files.append(open_samples(path, args, tokenizer, augmenter, log))
            files[-1].index_base, first_index = first_index, first_index + len(files[-1])  # distinct augmentation draws
        samples = files[0] if len(files) == 1 else ConcatenatedSamples(files)
        parts.append(PackedSFTDataset(samples, args.max_seq_len) if args.packing else samples)
        if source.ignored:
            log(f"[data] {source.spec}: left out {len(source.ignored)} entries that are not data files or are "
                f"subdirectories: {', '.join(path.name + ('/' if path.is_dir() else '') for path in source.ignored)}")
    note = lone_weight_note(sources)
    if note:
        log(note)
    mixture = EpochMixture([len(part) for part in parts], [source.weight for source in sources], args.seed)
    if len(sources) > 1:
        unit = "rows" if args.packing else "samples"
        log("[data] mixture per epoch: " + "; ".join(
            f"{source.name} {count} of {len(part)} {unit} (weight {source.weight:g}, {len(source.files)} file(s))"
            for source, part, count in zip(sources, parts, mixture.counts)))
    return MixtureDataset(parts, [source.name for source in sources]), mixture, opened


def build_train_data(args, tokenizer, ctx, sources: list | None = None) -> TrainData:
    """`sources`: --data_path parsed, as `check_data_files` returns it (parsed here when not given)."""
    # MiniMind's augmentations (off by default) act on cached samples, drawn per (seed, epoch, index).
    augmenter = ChatAugmenter(tokenizer, args.seed, args.system_prompt_ratio, args.drop_empty_think_ratio)
    sources = parse_data_path(args.data_path) if sources is None else sources
    build_token_caches([path for source in sources for path in source.files], args, tokenizer, ctx.local_rank)
    dataset, mixture, opened = build_mixture(args, sources, tokenizer, augmenter, rank_zero_log(ctx))
    if augmenter.prefixes and ctx.rank == 0:  # the share of the samples a system prompt fits
        print_escaped(augmenter.room_note([samples.prompt_room for _, files in opened for samples in files],
                                          args.max_seq_len))
    if ctx.rank == 0:  # what is supervised per segment, rows dropped and why, warnings: from a few hundred rows
        print_escaped("\n".join(training_summary([source for source, _ in opened], tokenizer, args.max_seq_len,
                                                  drop_empty_think=args.drop_empty_think_ratio > 0,
                                                  bad_data=args.bad_data)))
    sampler = ResumableDistributedSampler(
        len(dataset), num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed,
        lengths=dataset.lengths,  # also without grouping: a resume may finish an epoch in a grouped order
        # One group = one optimizer step's global batch: every rank and micro-step gets samples of
        # similar length, and the order stays the same for any split of that batch into
        # processes x micro-batches (so those equivalences and resumes keep holding).
        group_size=epoch_grouping(args, ctx.world_size),
        mixture=mixture,  # which samples each epoch holds (one source: every sample once)
    )
    workers = default_num_workers(args, ctx.device)
    loader = DataLoader(
        MarkFillers(dataset),  # the sampler's epoch-padding repeats count for nothing (dataset/epoch_padding.py)
        batch_size=args.batch_size,
        sampler=sampler,
        collate_fn=SFTCollator(pad_token_id=tokenizer.pad_token_id,
                               pad_to_multiple_of=COMPILE_PAD_MULTIPLE if args.use_compile else None,
                               max_length=args.max_seq_len),
        num_workers=workers,
        pin_memory=ctx.device.type == "cuda",
        # Worker seeds come from this generator, not the global RNG: resuming mid-epoch then
        # leaves the global RNG stream (dropout) exactly where the uninterrupted run had it.
        generator=torch.Generator().manual_seed(args.seed),
        worker_init_fn=_worker_ignores_preemption if workers else None,
    )
    return TrainData(dataset, sampler, loader, identify_run(args, tokenizer, opened), dataset.names)


def rank_zero_log(ctx):
    return print_escaped if ctx.rank == 0 else (lambda message: None)


def build_eval_sets(args, tokenizer, ctx, context: int) -> list[EvalSet]:
    """One EvalSet per held-out file. Each rank evaluates a disjoint slice of every file (no
    padding duplicates) and answers every world_size-th prompt of its generation subset; the
    evaluation sums over ranks. `context`: the model's (max_position_embeddings), which a prompt and
    its --eval_max_new_tokens share: the prompts that do not fit are counted here, once per file."""
    problem = (no_room_problem(context, args.eval_max_new_tokens, "--eval_max_new_tokens")
               if args.eval_generate_samples else None)  # no generation: nothing to fit
    if problem:
        raise ConfigError(problem)
    paths = held_out_files(args.eval_data_path)
    build_token_caches(paths, args, tokenizer, ctx.local_rank)
    eval_sets = []
    for name, path in zip(eval_set_names(paths), paths):
        dataset = build_dataset(path, args, tokenizer, log=rank_zero_log(ctx))
        samples = dataset.dataset if args.packing else dataset  # prompts come from whole conversations
        loader = DataLoader(
            dataset,
            batch_size=args.batch_size,
            sampler=list(range(ctx.rank, len(dataset), ctx.world_size)),
            collate_fn=SFTCollator(pad_token_id=tokenizer.pad_token_id),
            num_workers=0,
            pin_memory=ctx.device.type == "cuda",  # as in training: the copy to the GPU waits for nothing
        )
        examples = generation_examples(samples, args.eval_generate_samples, tokenizer, args.max_seq_len)
        if len(examples) < args.eval_generate_samples and ctx.rank == 0:
            why = (f"the file has only {len(samples)} conversations" if len(examples) == len(samples) else
                   f"only {len(examples)} of its {len(samples)} conversations end with a whole assistant turn "
                   "within --max_seq_len (the others reach it: it may have cut them)")
            print_escaped(f"[eval] {name}: {len(examples)} generation prompts of the {args.eval_generate_samples} "
                          f"asked for (--eval_generate_samples): {why}")
        cut = long_prompts([e.prompt_ids for e in examples], context, args.eval_max_new_tokens,
                           "--eval_max_new_tokens") if examples else None  # no generation: nothing to fit
        if cut and ctx.rank == 0:
            print_escaped(f"[eval] warning: {name}: {cut}")
        tool_turns = sum(bool(example.reference_calls) for example in examples)
        forwards = math.ceil(math.ceil(len(dataset) / ctx.world_size) / args.batch_size)  # rank 0 has the most
        eval_sets.append(EvalSet(name, loader, forwards, examples[ctx.rank::ctx.world_size],
                                 len(examples) - tool_turns, tool_turns,
                                 measurement_key(samples.data_digest, tokenizer, args.max_seq_len), len(samples)))
    return eval_sets
