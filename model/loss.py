"""The language-model loss: which positions carry a label, and the LM head + cross-entropy computed
in chunks of tokens so that a large vocabulary never holds all the fp32 logits at once."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
# Tokens x vocabulary entries of fp32 logits that the chunked LM loss holds at a time (256 MiB).
LOSS_CHUNK_ELEMENTS = 1 << 26


def loss_positions_of(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices into the B x T tokens of `labels` [B, T] whose NEXT token has a label (the
    positions whose hidden state predicts something). On a GPU tensor this is a host sync."""
    predicts = torch.zeros_like(labels, dtype=torch.bool)
    predicts[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return predicts.reshape(-1).nonzero().squeeze(1)


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum over the rows of logits [N, V] of their cross-entropy against targets [N], fp32; a target
    of IGNORE_INDEX counts nothing."""
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def head_loss_in_chunks(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                        token_losses: bool = False):
    """(`cross_entropy_sum(head(hidden), targets)`, the per-row values it summed or None): one call
    of `head` per `chunk_tokens` rows of hidden [N, H], so that no more than that many rows of
    logits and of their fp32 copy are held at once; at least one call, also for N = 0, so the sum is
    a tensor. N <= chunk_tokens is one call over all rows. The per-row values (`token_losses`) are
    detached. The head runs as a module, so a forward hook on it sees each call's logits in row
    order (trainer/evaluation/evaluate.py). The form for a forward without gradients: with them,
    autograd keeps every call's logits for the backward (`chunked_lm_loss` recomputes them)."""
    total, per_token = None, []
    for start in range(0, max(len(targets), 1), chunk_tokens):
        chunk_sum, chunk_losses = _head_loss(head, hidden[start:start + chunk_tokens],
                                             targets[start:start + chunk_tokens], token_losses)
        total = chunk_sum if total is None else total + chunk_sum
        per_token.append(chunk_losses)
    return total, (torch.cat(per_token) if token_losses else None)


def _head_loss(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, token_losses: bool):
    """One call of `head_loss_in_chunks`' loop: its logits live only until this returns."""
    logits = head(hidden).float()  # one fp32 copy for the sum and the per-token values
    per_token = F.cross_entropy(logits.detach(), targets, reduction="none") if token_losses else None
    return cross_entropy_sum(logits, targets), per_token


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                    token_losses: bool = False):
    """sum over tokens of cross_entropy(hidden @ weight.T, targets), fp32, `chunk_tokens` rows
    of logits at a time in the forward and again in the backward. hidden [N, H], weight [V, H],
    targets [N]. Under autocast the matmuls run in the autocast dtype, as `lm_head` would.
    `token_losses=True` returns (sum, the N per-token values it summed, detached).

    The chunk loop runs inside the custom ops `minisft::lm_loss_forward`/`lm_loss_backward`, so
    that torch.compile traces the call as one op whatever the number of loss tokens (no graph
    break, no recompile per count)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    elif hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    with torch.autocast(device_type, enabled=False):
        total, _log_norms, per_token = lm_loss_forward(hidden, weight, targets, chunk_tokens, token_losses)
    return (total, per_token.detach()) if token_losses else total


@torch.library.custom_op("minisft::lm_loss_forward", mutates_args=())
def lm_loss_forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                    keep_per_token: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`lm_loss_chunks` as one op."""
    return lm_loss_chunks(hidden, weight, targets, chunk_tokens, keep_per_token)


def lm_loss_chunks(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                   keep_per_token: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum, one log-sum-exp per token, per-token values or an empty tensor): the per-token buffer
    only when asked for (the trainer's per-source losses); the sum is the same either way, bit for bit."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    log_norms = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    per_token = torch.empty(hidden.shape[0] if keep_per_token else 0, dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        logits = hidden[start:end] @ weight.t()  # the compute dtype; the fp32 values come from it pass by pass
        log_norms[start:end] = log_sum_exp(logits)
        losses = log_norms[start:end] - logits.gather(1, targets[start:end, None]).squeeze(1)
        if keep_per_token:
            per_token[start:end] = losses
        total += losses.sum()
    return total, log_norms, per_token


def log_sum_exp(logits: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp(logits.float(), -1), bit for bit (ATen's steps: the row maximum, set to 0
    where infinite, subtracted before exp; a NaN maximum set to 0 too, its row's sum is NaN either
    way), without an fp32 copy of `logits`: the subtraction reads them in their own dtype and
    writes fp32, one pass where `.float()` and logsumexp's own subtraction take two."""
    maxes = logits.amax(-1, keepdim=True).float().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return (logits - maxes).exp_().sum(-1).log_().add_(maxes.squeeze(-1))


@lm_loss_forward.register_fake
def _lm_loss_forward_shapes(hidden, weight, targets, chunk_tokens, keep_per_token):
    tokens = hidden.shape[0]
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty(tokens, dtype=torch.float32),
            hidden.new_empty(tokens if keep_per_token else 0, dtype=torch.float32))


@torch.library.custom_op("minisft::lm_loss_backward", mutates_args=())
def lm_loss_backward(grad_total: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     log_norms: torch.Tensor, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`lm_loss_gradient_chunks` as one op."""
    return lm_loss_gradient_chunks(grad_total, hidden, weight, targets, log_norms, chunk_tokens)


def lm_loss_gradient_chunks(grad_total: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                            targets: torch.Tensor, log_norms: torch.Tensor,
                            chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the sum for hidden and weight; each chunk's logits are recomputed:
    softmax - one_hot(target) is the gradient of the logits, never stored whole."""
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        chunk = hidden[start:end]
        # softmax: the subtraction reads the logits in the compute dtype and writes fp32 (one pass)
        grad_logits = torch.sub(chunk @ weight.t(), log_norms[start:end, None]).exp_()
        grad_logits.scatter_add_(1, targets[start:end, None], grad_logits.new_full((len(chunk), 1), -1.0))
        # x grad_total in fp32, written straight in the compute dtype: the rounding of a product then a cast
        grad_logits = torch.mul(grad_logits, grad_total, out=torch.empty_like(grad_logits, dtype=hidden.dtype))
        grad_hidden[start:end] = grad_logits @ weight
        grad_weight.add_(grad_logits.t() @ chunk)  # reads the compute dtype, sums in fp32: no fp32 copy
    return grad_hidden, grad_weight.to(weight.dtype)


@lm_loss_backward.register_fake
def _lm_loss_backward_shapes(grad_total, hidden, weight, targets, log_norms, chunk_tokens):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _save_for_backward(ctx, inputs, output):
    hidden, weight, targets, chunk_tokens, _keep = inputs
    ctx.save_for_backward(hidden, weight, targets, output[1])
    ctx.chunk_tokens = chunk_tokens


def _backward(ctx, grad_total, _grad_log_norms, _grad_per_token):
    hidden, weight, targets, log_norms = ctx.saved_tensors
    grad_hidden, grad_weight = lm_loss_backward(grad_total, hidden, weight, targets, log_norms, ctx.chunk_tokens)
    return grad_hidden, grad_weight, None, None, None


lm_loss_forward.register_autograd(_backward, setup_context=_save_for_backward)
