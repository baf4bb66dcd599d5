"""Step 8: what rank 0 tells the user: a progress bar (on a terminal) or progress lines (in a
log file), `metrics.jsonl`, and optionally wandb.

Figures arrive here already reduced over ranks; this module never touches a device tensor, so
logging adds no host synchronisation beyond the one per log interval done by the loop.
"""

import json
import netrc
import os
import secrets
import sys
import time
from urllib.parse import urlparse

from dataset.printable import print_escaped, printable
from trainer.checkpoint.save_dir import METRICS_FILE
from trainer.errors import LoggingError

WANDB_MODES_WITHOUT_LOGIN = ("offline", "dryrun", "disabled")
# Every wandb row carries the optimizer step as this metric, the x-axis of every chart. wandb's own
# step only counts rows (it must only increase): a resume to an earlier checkpoint logs steps again,
# which an explicit `step=` would make wandb drop.
WANDB_STEP_METRIC = "train/step"


def check_wandb_login(args) -> None:
    """With `--use_wandb 1`: refuse at start, before the data and the model are built, when wandb is
    not installed; online, without touching the network, also when wandb has no credentials (it
    would otherwise fail with a long traceback, or prompt and hang)."""
    if not args.use_wandb:
        return
    try:
        import wandb  # noqa: F401 - imported here only to know it is there; the logger uses it
    except ModuleNotFoundError as error:
        if error.name != "wandb":  # wandb is there but one of its own imports fails: its traceback
            raise
        raise LoggingError("--use_wandb 1: wandb is not installed (pip install wandb)") from error
    if os.environ.get("WANDB_MODE", "").lower() in WANDB_MODES_WITHOUT_LOGIN:
        return
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    netrc_path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        if netrc.netrc(netrc_path).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise LoggingError(f"--use_wandb 1: not logged in to wandb ({host}): run `wandb login` or set WANDB_MODE=offline")


# Shown on the eval progress line: (metrics key, label, format).
EVAL_FIGURES = (("eval_loss", "eval_loss", ".4f"), ("eval_token_accuracy", "token_acc", ".4f"),
                ("eval_exact_match", "exact_match", ".4f"), ("eval_tool_call_accuracy", "tool_calls", ".4f"))


def format_duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def terminal_width() -> int:
    """Columns of the terminal on stdout; 0 when stdout is a file or pipe (log lines instead)."""
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else 0
    except (OSError, ValueError):
        return 0


def format_count(count: int, noun: str, plural: str | None = None) -> str:
    """`count` and `noun`, in its plural (`plural`, else `noun` + "s") unless `count` is 1."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def format_figure(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


class RunLogger:
    """Does nothing on ranks other than 0."""

    def __init__(self, args, is_main: bool, wandb_run_id: str | None = None, forked_from: dict | None = None):
        self.enabled = is_main
        self.metrics_path = os.path.join(args.save_dir, METRICS_FILE)
        self.wandb = None
        self.wandb_run_id = wandb_run_id
        self.run_id = None  # set by the loop: every metrics.jsonl row names the run it belongs to
        # Where this run's line of training comes from, said by the first metrics.jsonl row of this process:
        # a fork's origin (trainer/checkpoint/save_dir.py:Claim, also in its wandb config) and the line a
        # rollback left (trainer/loop/state.py:take_save_dir), by which scripts/plot_loss.py draws its history.
        self.origin = {"forked_from": forked_from} if forked_from else {}
        self.bar = None  # a tqdm bar when stdout is a terminal, else one line per log interval
        self.use_bar = is_main and terminal_width() > 0
        if self.enabled and args.use_wandb:
            self._start_wandb(args)

    def _start_wandb(self, args) -> None:
        import wandb

        run_id = self.wandb_run_id or secrets.token_hex(4)  # kept in every checkpoint, reused on resume
        try:
            self.wandb = wandb.init(
                project=args.wandb_project, name=args.wandb_run_name, id=run_id, resume="allow",
                config={**vars(args), **self.origin},
                dir=args.save_dir,
            )
        except wandb.errors.Error as error:  # no network, bad key, unknown project...: the user's to fix
            detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise LoggingError(f"--use_wandb 1: wandb could not start ({detail}); set WANDB_MODE=offline "
                               "to log locally and `wandb sync` later") from error
        self.wandb_run_id = run_id
        self.wandb.define_metric(WANDB_STEP_METRIC)
        self.wandb.define_metric("*", step_metric=WANDB_STEP_METRIC)

    def log_train(self, step: int, total_steps: int, epoch: int, epochs: int, figures: dict, eta_s: float) -> None:
        if not self.enabled:
            return
        line = (
            f"step {step}/{total_steps} (epoch {epoch + 1}/{epochs}) | loss {format_figure(figures['loss'], '.4f')} | "
            f"lr {figures['lr']:.2e} | grad_norm {format_figure(figures['grad_norm'], '.3f')} | "
            f"{figures['tokens_per_s']:,.0f} tok/s"
        )
        if "mfu" in figures:  # a GPU with a datasheet peak (trainer/loop/throughput.py)
            line += f" | mfu {100 * figures['mfu']:.1f}%"
        if "max_memory_gib" in figures:
            line += f" | mem {figures['max_memory_gib']:.1f} GiB"
        line += f" | eta {format_duration(eta_s)}"
        if figures.get("skipped_steps"):
            line += f" | skipped {figures['skipped_steps']}"
        by_source = [(key.split("/", 1)[1], value) for key, value in figures.items() if key.startswith("loss/")]
        if by_source:  # several training sources (trainer/loop/source_losses.py)
            line += " | " + " ".join(f"{name} {format_figure(value, '.4f')}" for name, value in by_source)
        if "resumed_at_step" in figures:  # the first window after a resume is shorter than --log_interval
            steps = figures["loss_steps"]
            line += f" | loss over {format_count(steps, 'step')} since the resume at step {figures['resumed_at_step']}"
        line = printable(line)  # the sources' names come from the user's files
        if self.use_bar:
            self._update_bar(step, total_steps, line)
        else:
            print(line, flush=True)
        self._record({"kind": "train", "step": step, "epoch": epoch, **figures})

    def log_eval(self, step: int, figures: dict, metric: str | None = None, best_value: float | None = None,
                 best_step: int | None = None, new_best: bool = False) -> None:
        """One evaluation: a line per held-out file (the overall one first, then the files in the order
        of `figures`: --eval_data_path's), one metrics.jsonl row."""
        if not self.enabled:
            return
        for name in [None, *dict.fromkeys(key.split("/", 1)[1] for key in figures if "/" in key)]:
            suffix = f"/{name}" if name else ""
            parts = [f"eval step {step}" + (f" [{name}]" if name else "")]
            for key, label, spec in EVAL_FIGURES:
                if key + suffix in figures:
                    parts.append(f"{label} {format(figures[key + suffix], spec)}")
            if not name and metric and best_value is not None:
                parts.append(f"best {metric} {best_value:.4f} @ step {best_step}" + (" (new, saved best/)" if new_best else ""))
            self.print(" | ".join(parts))
        row = {"kind": "eval", "step": step, **figures}
        if metric:
            row.update(best_metric=metric, best_value=best_value, best_step=best_step, new_best=new_best)
        self._record(row)

    def log_early_stop(self, step: int, metric: str, evaluations: int, best_value: float, best_step: int) -> None:
        if not self.enabled:
            return
        self.print(f"early stop at step {step}: {metric} has not improved in {evaluations} evaluations "
                   f"(best {best_value:.4f} at step {best_step}, kept in best/)")
        self._record({"kind": "early_stop", "step": step, "best_metric": metric, "best_value": best_value,
                      "best_step": best_step, "evaluations_without_improvement": evaluations})

    def _record(self, row: dict) -> None:
        row = {**row, "run_id": self.run_id, "time": time.time()}
        row.update(self.origin)
        self.origin = {}
        try:
            with open(self.metrics_path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
        except OSError as error:
            raise LoggingError(f"could not write {self.metrics_path}: {error.strerror or error}") from error
        if self.wandb is not None:
            figures = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
            # numbers only (not kind, best_metric); wandb counts its own step (see WANDB_STEP_METRIC)
            self.wandb.log({WANDB_STEP_METRIC: row["step"], **figures})

    def _update_bar(self, step: int, total_steps: int, line: str) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True, file=sys.stdout)
        self.bar.update(step - self.bar.n)
        self.bar.set_description_str(line.split(" | ", 1)[1], refresh=True)  # loss, lr, grad norm, tok/s, eta

    def print(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(printable(message))
        else:
            print_escaped(message)

    def finish(self, exit_code: int = 0) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.wandb is not None:
            self.wandb.finish(exit_code=exit_code)
            self.wandb = None
        sys.stdout.flush()

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.finish(exit_code=0 if kind is None else 1)
