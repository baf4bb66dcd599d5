"""How long a save stalls the training loop: the trainer's background save (trainer/loop/saves.py:
a host copy, then a writer thread) against a synchronous one (the same files written before the
loop goes on).

    python scripts/bench_save.py                                    # ~110M parameters, CPU
    python scripts/bench_save.py --device cuda --hidden_size 1024 --num_hidden_layers 12

A model of the given shape (random weights, AdamW state after one real step) trains `--steps`
optimizer steps of one `--seq_len`-token row three times: without a save, with a synchronous save
after step `--steps // 2`, and with the background save there. The stall of a save is the extra
wall time of the loop with it, against the loop without; it also counts a slower loop while the
writer thread shares the machine. "call" is the time the loop spent inside the save call (the host
copy; synchronous: the whole save); "write" the time until the files were complete. Each of the
three runs `--repeats` times; the median is shown. Files go to a temporary directory
(`--work_dir`), removed at the end.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts._common import ArgumentParser, resolve_device, run_main  # noqa: E402
from trainer.args import add_flag, flag_bounds  # noqa: E402


def parse(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))  # the first paragraph
    for name, default, meaning in (("hidden_size", 1024, "the model's width"), ("num_hidden_layers", 8, "blocks"),
                                   ("num_attention_heads", 16, "query heads"), ("num_key_value_heads", 8, "k/v heads")):
        parser.add_argument(f"--{name}", type=int, default=default, help=meaning).bounds = flag_bounds(name)
    add_flag(parser, "--steps", type=int, default=6, at_least=2,
             help="optimizer steps per timed loop (at least 2: the save comes after step --steps // 2)")
    seq_len = parser.add_argument("--seq_len", type=int, default=64,
                                  help="tokens of the one row each step trains on (at least 2, as the trainer's "
                                       "--max_seq_len: the first token has no label)")
    seq_len.bounds = flag_bounds("max_seq_len")
    add_flag(parser, "--repeats", type=int, default=3, at_least=1, help="timed loops of each kind (the median is shown)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--work_dir", default=None, help="where the files are written (default: a temporary dir)")
    return parser.parse_args(argv)  # the ranges: checked by parse_args


def build(options, device, save_dir: str):
    """A Run of the trainer's pieces (model, AdamW, the save path) around a model of the given shape."""
    import torch

    from dataset.rendering import load_tokenizer
    from model import MiniMindForCausalLM
    from trainer.loop.state import Run
    from trainer.model_setup import build_optimizer, new_model_config
    from trainer.parallel.ddp import Replicated
    from trainer.runtime.distributed import DistContext
    from trainer.runtime.precision import build_grad_scaler

    tokenizer = load_tokenizer(None)
    config = new_model_config(vocab_size=len(tokenizer), hidden_size=options.hidden_size,
                              num_hidden_layers=options.num_hidden_layers,
                              num_attention_heads=options.num_attention_heads,
                              num_key_value_heads=options.num_key_value_heads)
    torch.manual_seed(0)
    model = MiniMindForCausalLM(config).to(device).train()
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=device, backend=None)
    args = SimpleNamespace(save_dir=save_dir, keep_last=2, save_dtype="bfloat16", save_weight=None,
                           learning_rate=1e-4, weight_decay=0.01)
    parallel = Replicated(ctx)
    wrapped = parallel.wrap(model)
    return Run(args, ctx, wrapped, build_optimizer(model, args, device), build_grad_scaler(device, torch.float32),
               torch.float32, data=None, eval_sets=[], tokenizer=tokenizer,
               logger=SimpleNamespace(print=lambda message: None), preemption=None, parallel=parallel)


def resume_content(run) -> dict:
    """What trainer/loop/state.py's resume_state holds that costs time to copy and write: the model
    and AdamW state (the run's position, RNG and flags are a few kilobytes)."""
    return {"step": run.state.step, "model": run.raw_model.state_dict(), "optimizer": run.optimizer.state_dict()}


def train_step(run, row) -> None:
    run.optimizer.zero_grad(set_to_none=True)
    run.model(input_ids=row, labels=row).loss.backward()
    run.optimizer.step()
    run.state.step += 1


def save_synchronously(run) -> None:
    """The same files, written before the loop goes on."""
    import torch

    from trainer.checkpoint import single_file
    from trainer.weights.write import publish_inference_weights

    single_file.save(resume_content(run), run.args.save_dir, run.args.keep_last)
    publish_inference_weights(run.raw_model, run.tokenizer, run.args.save_dir, torch.bfloat16)


def timed_loop(run, row, kind: str, synchronize) -> tuple[float, float, float]:
    """(seconds of the loop, seconds in the save call, seconds the save's write took) for one loop of `kind`."""
    from trainer.loop import saves

    call = write = 0.0
    synchronize()
    start = time.perf_counter()
    for index in range(run.args.steps):
        train_step(run, row)
        if index + 1 == run.args.steps // 2:
            saved_at = time.perf_counter()
            if kind == "synchronous":
                save_synchronously(run)
            elif kind == "background":
                saves.save_in_background(run)
            synchronize()  # on a GPU: the host copy included
            call = write = time.perf_counter() - saved_at
    synchronize()
    elapsed = time.perf_counter() - start
    if kind == "background":
        run.writer.wait()  # the loop itself did not wait for the write; how long it took:
        write = time.perf_counter() - saved_at
    return elapsed, call, write


def measure(options) -> list[tuple[str, float, float, float, float]]:
    import torch

    from trainer.loop import saves

    device = resolve_device(options.device)
    work = tempfile.mkdtemp(prefix="minisft-bench-save-", dir=options.work_dir)
    real_resume_state = saves.resume_state
    try:
        run = build(options, device, work)
        run.args.steps = options.steps
        # A Run without data: only the tensors of the resume state; the trainer's own function is put
        # back afterwards, for a training run later in the same process (this one's caller).
        saves.resume_state = resume_content
        parameters = sum(p.numel() for p in run.raw_model.parameters())
        generator = torch.Generator().manual_seed(1)
        row = torch.randint(0, run.raw_model.config.vocab_size, (1, options.seq_len), generator=generator).to(device)
        synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        train_step(run, row)  # AdamW's state exists; first-step allocations are not timed
        print(f"model: {parameters / 1e6:.1f}M parameters ({options.hidden_size} x {options.num_hidden_layers}), "
              f"resume state {parameters * 12 / 2**30:.2f} GiB (fp32 weights + AdamW), device {device}, "
              f"torch {torch.__version__}, {options.steps} steps of {options.seq_len} tokens, "
              f"median of {options.repeats}")
        results = {kind: [] for kind in ("no save", "synchronous", "background")}
        for _ in range(options.repeats):
            for kind in results:
                results[kind].append(timed_loop(run, row, kind, synchronize))
        base = statistics.median(elapsed for elapsed, _, _ in results["no save"])
        rows = []
        for kind, runs in results.items():
            elapsed = statistics.median(e for e, _, _ in runs)
            rows.append((kind, elapsed, elapsed - base, *(statistics.median(r[i] for r in runs) for i in (1, 2))))
        return rows
    finally:
        saves.resume_state = real_resume_state
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    options = parse(argv)
    rows = measure(options)
    print(f"{'save':<12} {'loop s':>8} {'stall s':>8} {'call s':>8} {'write s':>8}")
    for kind, elapsed, stall, call, write in rows:
        print(f"{kind:<12} {elapsed:8.2f} {stall:8.2f} {call:8.2f} {write:8.2f}")
    return 0


if __name__ == "__main__":
    run_main(main)
