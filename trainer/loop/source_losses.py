"""Loss and loss tokens per training source (a `--data_path` of several sources), per log window.

The model returns each loss position's cross-entropy (`return_token_losses`, in the order of the
collator's `loss_positions`) and the collator says each position's source (`loss_sources`). Per
micro-batch the sums per source are added on the device (no host sync, deterministic); the loss tokens per
source are counted from the CPU batch. A step's sums are divided by the step's global loss-token
count, as the step's loss is, and kept only for a finite step, as the loss is (on the device; the
host counts of a step are kept until the log line, which knows which steps were finite). At the
log step one all-reduce (the window's only extra sync) gives, per source `s`:

    loss/s        sum over the window's steps of (s's token losses / the step's loss tokens),
                  divided by share/s: s's mean token loss, each token weighted as in `loss`
    loss_tokens/s s's loss tokens in the window (all ranks)
    loss_share/s  the mean over the window's steps of s's fraction of the step's loss tokens

so that sum_s loss_share/s * loss/s == loss (the mean of the window's step losses) for any
`--log_interval`; with one step per window loss_share/s is loss_tokens/s / sum of loss_tokens,
i.e. the token-weighted per-source losses sum back to the loss.
"""

import torch

from trainer.runtime.distributed import all_reduce_sum


class SourceLosses:
    def __init__(self, names: list[str], device: torch.device):
        self.names = list(names)
        self.device = device
        self.window_loss = torch.zeros(len(names), dtype=torch.float32, device=device)
        # each step's (loss tokens, per source, finite: a bool or a bool tensor on the device)
        self.window_steps: list[tuple[int, list[int], bool | torch.Tensor]] = []
        self.source_numbers = torch.arange(len(names), device=device)
        self.start_step()

    def start_step(self) -> None:
        self.step_sums = torch.zeros(len(self.names), dtype=torch.float32, device=self.device)
        self.step_tokens = [0] * len(self.names)

    def add_micro_batch(self, token_losses: torch.Tensor, batch: dict) -> None:
        """One micro-batch's per-position losses (on the device) and its CPU `loss_sources`."""
        sources = batch["loss_sources"]
        # [sources x positions] membership times the losses: deterministic (index_add_ is not, on a GPU)
        member = sources.to(self.device, non_blocking=True)[None, :] == self.source_numbers[:, None]
        self.step_sums += member.float() @ token_losses.float()
        for source, count in enumerate(torch.bincount(sources, minlength=len(self.names)).tolist()):
            self.step_tokens[source] += count

    def end_step(self, step_loss_tokens: int, finite: bool | torch.Tensor) -> None:
        """Close the step (its global loss-token count); a non-finite step is left out, as from `loss`."""
        if step_loss_tokens:
            applied = torch.as_tensor(finite, device=self.device)
            self.window_loss += torch.where(applied, self.step_sums / step_loss_tokens, 0.0)
        self.window_steps.append((step_loss_tokens, self.step_tokens, finite))
        self.start_step()

    def figures(self, finite: list[bool] | None = None) -> dict:
        """The window's per-source figures, reduced over ranks (collective), then a new window.
        `finite`: which of the window's steps were applied, as the loop has read them (None: read here)."""
        count = len(self.names)
        if finite is None:
            finite = [bool(applied) for _, _, applied in self.window_steps]
        shares, tokens = [0.0] * count, [0] * count
        for (step_loss_tokens, step_tokens, _), applied in zip(self.window_steps, finite, strict=True):
            for source, tokens_of in enumerate(step_tokens if applied and step_loss_tokens else ()):
                shares[source] += tokens_of / step_loss_tokens
                tokens[source] += tokens_of
        steps = sum(finite)
        host = torch.tensor(shares + tokens, dtype=torch.float64, device=self.device)
        reduced = all_reduce_sum(torch.cat([self.window_loss.double(), host])).tolist()
        losses, shares, tokens = reduced[:count], reduced[count:2 * count], reduced[2 * count:]
        figures = {}
        for name, loss, share, tokens_of in zip(self.names, losses, shares, tokens):
            figures[f"loss/{name}"] = loss / share if share else None
            figures[f"loss_tokens/{name}"] = int(tokens_of)
            figures[f"loss_share/{name}"] = share / steps if steps else None
        self.window_loss.zero_()
        self.window_steps = []
        return figures
