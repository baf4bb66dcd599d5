"""Check on your own hardware, with your flags and data, that the trainer's mathematics holds.

    python scripts/verify_equivalence.py --nproc_per_node 2 --data_path my.jsonl --batch_size 4 --dtype float32
    torchrun --nproc_per_node 8 scripts/verify_equivalence.py --batch_size 2 ...         # the 8 processes
    torchrun --nnodes 2 --node_rank R ... scripts/verify_equivalence.py --work_dir /shared/tmp ...

Every flag this script does not know is a trainer flag. The real train_full_sft.py trains --max_steps
(S, default 8) optimizer steps four ways with the same global batch (B = --batch_size, A =
--accumulation_steps, M = N processes, or 2 when N = 1): 1 process x M*B (the reference); N processes
x B (torchrun --standalone, or the world this script was started in); 1 process x B x accumulation
M*A; and a fresh run resumed from the N-process run's (N = 1: the reference's) step-K checkpoint.
Each run's final resume checkpoint (read by trainer/checkpoint/resume.py) is compared with the
reference's (a resumed run's: with its own uninterrupted run's): `max |diff|`, the largest elementwise
difference; `rel diff`, ||w - w_ref|| / ||w_ref(step S) - w_ref(step K)|| over all weights. Tolerance
on rel diff: float32 1e-3 (IEEE matmuls: --tf32 is the check's), bfloat16 and float16 0.2 (gross errors only). Exit 0: all
within tolerance; 1: one is not, or a run failed; 2: a user error. docs/verify_equivalence.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._common import REPO_DIR, ArgumentParser, fail, run_main  # noqa: E402

TRAINER = str(REPO_DIR / "train_full_sft.py")
TOLERANCES = {"float32": 1e-3, "bfloat16": 0.2, "float16": 0.2}
# Trainer flags the check sets itself: given ones are dropped (named in a note).
OWNED = ("save_dir", "save_interval", "keep_last", "overwrite", "from_resume", "max_steps", "use_wandb",
         "wandb_project", "wandb_run_name", "eval_data_path", "eval_interval", "eval_generate_samples",
         "eval_max_new_tokens", "keep_best", "early_stop_patience", "tf32", "save_every_minutes")
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
              "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
WHAT_FAILED = {
    "procs": "suspect the loss normalisation or the gradient reduction across processes",
    "accum": "suspect the loss normalisation across micro-batches",
    "resume": "suspect the resume state: optimizer, RNG, sample position or LR schedule",
}


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="verify_equivalence.py", allow_abbrev=False,
                            usage="%(prog)s [options] [train_full_sft.py flags ...]",
                            description=__doc__.split("\n\n")[0],
                            epilog="Every other flag goes to train_full_sft.py (model size, --dtype, --data_path, "
                                   "--max_seq_len, --packing, --batch_size, --from_weight, ...).")
    parser.add_argument("--nproc_per_node", default="auto",
                        help="N processes of the N-process variant: auto = the visible GPUs, 1 on CPU; ignored "
                             "under torchrun (the world size is used)")
    parser.add_argument("--max_steps", type=int, default=8, help="optimizer steps of every run (S)")
    parser.add_argument("--resume_step", type=int, default=None, help="K: where the resumed run starts (default S/2)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest rel diff allowed (default by dtype: float32 1e-3, bfloat16 and float16 0.2)")
    parser.add_argument("--work_dir", default=None,
                        help="where the runs' directories go (default: the system temp dir); on several nodes "
                             "a directory every node sees")
    parser.add_argument("--keep_files", type=int, choices=(0, 1), default=0,
                        help="1 = keep the runs' directories (they are always kept after a FAIL)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one trainer run may take")
    return parser


@dataclasses.dataclass
class Variant:
    name: str
    kind: str  # reference | procs | accum | resume: also its directory's name
    nproc: int
    batch: int
    accum: int
    resumes: "Variant | None" = None


@dataclasses.dataclass
class Plan:
    trainer_argv: list[str]
    max_steps: int
    resume_step: int
    variants: list[Variant]
    world: "World | None"
    work: Path | None = None

    @property
    def is_main(self) -> bool:
        return self.world is None or self.world.rank == 0


# --------------------------------------------------------------------------- flags


def drop_flags(argv: list[str], dests) -> tuple[list[str], list[str]]:
    """`argv` without the trainer flags whose destination is in `dests` (and their values)."""
    from trainer.args import build_parser as trainer_parser

    actions = {name: action for action in trainer_parser()._actions for name in action.option_strings}
    kept, dropped, index = [], [], 0
    while index < len(argv):
        token = argv[index]
        action = actions.get(token.split("=", 1)[0])
        index += 1
        if action is None or action.dest not in dests:
            kept.append(token)
            continue
        dropped.append(token.split("=", 1)[0])
        if "=" not in token and (action.nargs != "?" or (index < len(argv) and not argv[index].startswith("-"))):
            index += 1  # its value
    return kept, dropped


def parse_trainer_flags(argv: list[str]):
    """The trainer's own parsing and checks of `argv`; its error becomes one line (exit 2)."""
    from trainer.args import parse_args

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return parse_args(argv)
    except SystemExit:
        lines = captured.getvalue().strip().splitlines() or ["error: invalid trainer flags"]
        fail(f"{lines[-1].split('error: ', 1)[-1]} (a trainer flag: see python train_full_sft.py --help)")


def make_plan(argv: list[str]):
    """(the plan, this script's flags, the trainer's parsed flags); refuses what the check cannot run."""
    tool, rest = build_parser().parse_known_args(argv)
    world = World.from_env(tool)
    rest, dropped = drop_flags(rest, OWNED)
    args = parse_trainer_flags(rest)
    if dropped and (world is None or world.rank == 0):
        print(f"note: the check sets {', '.join(sorted(set(dropped)))} itself: your value is not used")
    if args.resume_from:
        fail("--resume_from: every run of the check starts from the same weights; use --from_weight to start "
             "from trained weights")
    if args.world_size > 1:
        fail("--world_size: give the processes with --nproc_per_node, or start this script with torchrun")
    if args.dropout > 0:
        fail(f"--dropout {args.dropout:g}: dropout masks differ between process layouts, so the runs cannot "
             "agree; check with --dropout 0")
    if tool.max_steps < 2:
        fail(f"--max_steps must be >= 2 (got {tool.max_steps})")
    resume_step = tool.resume_step if tool.resume_step is not None else tool.max_steps // 2
    if not 1 <= resume_step < tool.max_steps:
        fail(f"--resume_step must be between 1 and --max_steps - 1 = {tool.max_steps - 1} (got {resume_step})")
    for flag, value in (("tolerance", tool.tolerance), ("timeout", tool.timeout)):  # --timeout 0: every run "fails"
        if value is not None and not (value > 0 and math.isfinite(value)):
            fail(f"--{flag} must be a positive number (got {value})")
    nproc = world.size if world else process_count(tool.nproc_per_node)
    rest, _ = drop_flags(rest, ("batch_size", "accumulation_steps"))
    plan = Plan(rest, tool.max_steps, resume_step, [], world)
    plan.variants = variants(nproc, args.batch_size, args.accumulation_steps, resume_step)
    return plan, tool, args


def process_count(value: str) -> int:
    if value == "auto":
        import torch

        return max(torch.cuda.device_count(), 1)
    if not value.isdigit() or int(value) < 1:
        fail(f"--nproc_per_node must be auto or a number >= 1 (got {value!r})")
    return int(value)


def variants(nproc: int, batch: int, accum: int, resume_step: int) -> list[Variant]:
    """The runs, reference first (one process first, then the N-process ones)."""
    multiple = nproc if nproc > 1 else 2

    def label(processes: int, rows: int, accumulation: int) -> str:
        text = f"{processes} process{'es' if processes > 1 else ''} x batch {rows}"
        return text + (f" x accumulation {accumulation}" if accumulation > 1 else "")

    reference = Variant(label(1, multiple * batch, accum) + " (reference)", "reference", 1, multiple * batch, accum)
    found = [reference, Variant(label(1, batch, multiple * accum), "accum", 1, batch, multiple * accum)]
    base = reference
    if nproc > 1:
        base = Variant(label(nproc, batch, accum), "procs", nproc, batch, accum)
        found.append(base)
    found.append(Variant(f"{base.name.removesuffix(' (reference)')}, resumed at step {resume_step}", "resume",
                         base.nproc, base.batch, base.accum, resumes=base))
    return found


# --------------------------------------------------------------------------- launching


class World:
    """This script started by torchrun (one process per rank, on one or several nodes): the
    N-process runs use these ranks, each starting its trainer process; rank 0 does the rest. The
    ranks talk through torchrun's store; each trainer run gets a store prefix of its own."""

    def __init__(self, rank: int, size: int, store):
        self.rank, self.size, self.store = rank, size, store
        self.launches = 0

    @classmethod
    def from_env(cls, tool) -> "World | None":
        env = os.environ
        if int(env.get("WORLD_SIZE", "1")) <= 1 and int(env.get("SLURM_NTASKS", "1")) <= 1:
            return None
        if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            fail("several processes need torchrun's store: start this script with torchrun (one per node; not with "
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), or with plain python and --nproc_per_node N")
        if int(env["WORLD_SIZE"]) > int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])) and not tool.work_dir:
            fail("on several nodes give --work_dir on a filesystem every node sees: the resumed run reads its "
                 "checkpoint on every node")
        import torch.distributed as dist

        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                              timeout=datetime.timedelta(seconds=tool.timeout * 4 + 600))
        prefix = f"minisft-verify/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), dist.PrefixStore(prefix, store))

    def trainer_env(self) -> dict:
        """This rank's environment, with a store prefix no earlier trainer run of this job used
        (the trainer keys its process group by TORCHELASTIC_RESTART_COUNT under torchrun)."""
        self.launches += 1
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return {**os.environ, "TORCHELASTIC_RESTART_COUNT": str(1000 * (restart + 1) + self.launches),
                "PYTHONUNBUFFERED": "1"}

    def share(self, key: str, value: str | None = None) -> str:
        if self.rank == 0:
            self.store.set(key, value)
            return value
        return self.store.get(key).decode()


def local_env() -> dict:
    env = {key: value for key, value in os.environ.items()
           if key not in LAUNCH_ENV and not key.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_"))}
    return {**env, "PYTHONUNBUFFERED": "1"}


def run_variant(plan: Plan, variant: Variant, args, timeout: float) -> tuple[int, str, float]:
    """Run the trainer for `variant`; (exit code, its output, seconds)."""
    save_dir = plan.work / variant.kind
    flags = [*plan.trainer_argv, "--batch_size", str(variant.batch), "--accumulation_steps", str(variant.accum),
             "--max_steps", str(plan.max_steps), "--save_interval", str(plan.resume_step),
             "--keep_last", str(plan.max_steps // plan.resume_step + 1), "--save_dir", str(save_dir)]
    if variant.resumes:
        flags += ["--resume_from", checkpoint_at(plan.work / variant.resumes.kind, plan.resume_step)]
    if variant.nproc == 1:
        command, env = [sys.executable, TRAINER, *flags], local_env()
    elif plan.world:
        command, env = [sys.executable, TRAINER, *flags], plan.world.trainer_env()
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                   str(variant.nproc), TRAINER, *flags]
        env = local_env()
    log = plan.work / (f"{variant.kind}.log" if plan.is_main else f"{variant.kind}.rank{plan.world.rank}.log")
    start = time.time()
    # Its own process group, so that a timeout or Ctrl-C here stops torchrun's workers too.
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, code = proc.communicate(timeout=timeout)[0], proc.returncode
    except subprocess.TimeoutExpired:
        stop_group(proc)
        output, code = proc.communicate()[0] + f"\n(stopped after --timeout {timeout:g} s)", 124
    except BaseException:
        stop_group(proc)
        raise
    with contextlib.suppress(OSError):
        log.write_text(output, encoding="utf-8")
    return code, output, time.time() - start


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM (the trainer then stops at the next step), SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def checkpoint_at(save_dir: Path, step: int) -> str:
    from trainer.checkpoint.save_dir import checkpoint_path, list_checkpoints, step_of

    found = [path for path in list_checkpoints(str(save_dir)) if step_of(path) == step]
    return found[0] if found else checkpoint_path(str(save_dir), step)


def error_line(output: str) -> str:
    """The trainer's one-line error, else the last line of its output."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    return (errors or lines or ["(no output)"])[-1]


# --------------------------------------------------------------------------- comparing


def final_weights(save_dir: Path) -> tuple[int, dict]:
    from trainer.checkpoint.resume import load_resume_checkpoint
    from trainer.checkpoint.save_dir import list_checkpoints

    found = list_checkpoints(str(save_dir))
    if not found:
        raise FileNotFoundError(f"no resume checkpoint in {save_dir}")
    saved = load_resume_checkpoint(found[0], required=("model", "step"))
    return saved["step"], saved["model"]


def compare(reference: dict, earlier: dict, other: dict) -> tuple[float, float, str]:
    """(max |diff|, rel diff, worst tensor): the largest elementwise difference; ||other - reference||
    over all weights / ||reference - earlier|| over all weights; the tensor whose own such ratio is
    the largest, with that ratio."""
    import torch

    if set(reference) != set(other):
        return math.inf, math.inf, f"different tensors: {sorted(set(reference) ^ set(other))[0]}, ..."
    max_abs, diff_sq, moved_sq, worst, worst_rel = 0.0, 0.0, 0.0, "-", -1.0
    for name, ref in reference.items():
        if not torch.is_floating_point(ref):
            continue
        ref = ref.double()
        diff = other[name].double() - ref
        if not torch.isfinite(diff).all():
            return math.inf, math.inf, f"{name} (not finite)"
        size, moved = diff.norm().item(), (ref - earlier[name].double()).norm().item()
        diff_sq, moved_sq = diff_sq + size**2, moved_sq + moved**2
        max_abs = max(max_abs, diff.abs().max().item())
        rel = 0.0 if size == 0 else (size / moved if moved > 0 else math.inf)
        if rel > worst_rel:
            worst, worst_rel = name, rel
    rel = 0.0 if diff_sq == 0 else (math.sqrt(diff_sq / moved_sq) if moved_sq > 0 else math.inf)
    return max_abs, rel, f"{worst} ({worst_rel:.2g})" if worst_rel > 0 else "-"


def run_facts(output: str) -> tuple[str, str]:
    """(dtype, device) from the trainer's 'training N optimizer steps ...' line."""
    match = re.search(r"dtype (\w+), device (\S+)", output)
    return (match.group(1), match.group(2)) if match else ("float32", "?")


def report(plan: Plan, facts: tuple[str, str], tolerance: float | None) -> int:
    """Print the table and the verdict; 0 when every variant is within tolerance, else 1."""
    from trainer.checkpoint.resume import load_resume_checkpoint

    dtype, device = facts
    tolerance = tolerance if tolerance is not None else TOLERANCES.get(dtype, TOLERANCES["bfloat16"])
    reference = plan.variants[0]
    finals = {v.kind: final_weights(plan.work / v.kind) for v in plan.variants}
    rows, failed = [[reference.name, "-", "-", "-", "-", "-", "-"]], []
    for variant in plan.variants[1:]:
        against = variant.resumes or reference  # a resumed run against its own uninterrupted run
        (step, weights), (against_step, against_weights) = finals[variant.kind], finals[against.kind]
        earlier = load_resume_checkpoint(checkpoint_at(plan.work / against.kind, plan.resume_step),
                                         required=("model",))["model"]
        max_abs, rel, worst = compare(against_weights, earlier, weights)
        if step != against_step:
            rel, worst = math.inf, f"ended at step {step}, not {against_step}"
        ok = rel <= tolerance
        rows.append([variant.name, "reference" if against is reference else against.name, f"{max_abs:.3g}",
                     f"{rel:.3g}", f"{tolerance:.0e}", "OK" if ok else "FAIL", worst])
        if not ok:
            failed.append(f"{variant.name} differs by {rel:.3g} > {tolerance:.0e} ({WHAT_FAILED[variant.kind]})")
    print(f"\nverify_equivalence: {finals[reference.kind][0]} optimizer steps of train_full_sft.py, global batch "
          f"{reference.batch * reference.accum}, dtype {dtype}, device {device}, resume at step {plan.resume_step}")
    header = ["variant", "against", "max |diff|", "rel diff", "tolerance", "result", "worst tensor (its rel diff)"]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    if dtype != "float32":
        print(f"note: in {dtype} rounding alone moves the runs apart by several % of an update, so only gross "
              "errors show; rerun with --dtype float32 for the sharp check")
    unchecked = "" if any(v.nproc > 1 for v in plan.variants) else (
        "; not checked: several processes (one process here; --nproc_per_node 2 runs two, with gloo on a CPU)")
    print(f"verdict: FAIL: {'; '.join(failed)}{unchecked}" if failed else
          f"verdict: OK: all {len(rows) - 1} variants agree within {tolerance:.0e} ({dtype}){unchecked}")
    return 1 if failed else 0


# --------------------------------------------------------------------------- main


def execute(plan: Plan, runs: list[Variant], args, tool, outputs: dict) -> int:
    """Run `runs` in order; 0, or the exit code to end with (the error is printed)."""
    for variant in runs:
        if plan.is_main:
            print(f"running {variant.name} ...", flush=True)
        code, output, seconds = run_variant(plan, variant, args, tool.timeout)
        outputs[variant.kind] = output
        if code == 0:
            if plan.is_main:
                print(f"  done in {seconds:.1f} s", flush=True)
            resumed = any(later.resumes == variant for later in runs)  # checked at once: no run in between
            if resumed and not os.path.exists(checkpoint_at(plan.work / variant.kind, plan.resume_step)):
                print(f"error: {variant.name} ended before step {plan.resume_step} (too little data for "
                      "this global batch): lower --resume_step, --max_steps or --batch_size", file=sys.stderr)
                return 2
            continue
        if code == 2 and (variant.nproc == 1 or plan.world):
            print(error_line(output), file=sys.stderr)  # the trainer's one-line user error
            return 2
        print(f"error: {variant.name}: the trainer failed (exit {code}): {error_line(output)}; its output: "
              f"{plan.work / (variant.kind + '.log')}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    plan, tool, args = make_plan(sys.argv[1:] if argv is None else argv)
    world, main_rank = plan.world, plan.is_main
    if main_rank:
        if tool.work_dir:
            os.makedirs(tool.work_dir, exist_ok=True)
        plan.work = Path(tempfile.mkdtemp(prefix="minisft-verify-", dir=tool.work_dir)).resolve()
    if world:
        plan.work = Path(world.share("work_dir", str(plan.work)))
    single, multi = [v for v in plan.variants if v.nproc == 1], [v for v in plan.variants if v.nproc > 1]
    outputs, code = {}, 0
    if main_rank:
        code = execute(plan, single if world else plan.variants, args, tool, outputs)
    if world:
        code = int(world.share("single_runs", str(code)))
        if code == 0:
            code = execute(plan, multi, args, tool, outputs)
    if main_rank and code == 0:
        code = report(plan, run_facts(outputs["reference"]), tool.tolerance)
    if world:
        code = int(world.share("verdict", str(code))) if main_rank or code == 0 else code
    if main_rank:
        if code == 0 and not tool.keep_files:
            shutil.rmtree(plan.work, ignore_errors=True)
        else:
            print(f"the runs' directories and logs: {plan.work}")
    return code


if __name__ == "__main__":
    run_main(main)
