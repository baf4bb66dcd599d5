"""model/loss.py and the model's loss: shifted cross-entropy by hand, chunked, from the collator's positions."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.tiny_model import packed_rows, tiny_model


def test_loss_equals_hand_written_shifted_cross_entropy():
    model = tiny_model()
    ids = torch.randint(0, 97, (3, 10))
    labels = ids.clone()
    labels[0, :4] = -100
    labels[2, 6:] = -100
    out = model(ids, labels=labels)
    logits = out.logits
    total, count = 0.0, 0
    for b in range(3):
        for t in range(9):
            target = labels[b, t + 1].item()
            if target == -100:
                continue
            total += -torch.log_softmax(logits[b, t].double(), -1)[target].item()
            count += 1
    assert out.loss.item() == pytest.approx(total / count, rel=1e-6)
    # labels of -100 count nothing: the hand computation above skips them, and the sum form agrees
    summed = model(ids, labels=labels, num_items_in_batch=7).loss
    assert summed.item() == pytest.approx(total / 7, rel=1e-6)
    only_loss = model(ids, labels=labels, skip_logits=True)
    assert only_loss.logits is None
    assert only_loss.loss.item() == pytest.approx(total / count, rel=1e-6)
    assert out.aux_loss.item() == 0.0


def test_all_ignored_labels_give_zero_loss_not_nan():
    model = tiny_model()
    ids = torch.randint(0, 97, (2, 6))
    out = model(ids, labels=torch.full_like(ids, -100))
    assert out.loss.item() == 0.0


def test_chunked_lm_loss_equals_the_unchunked_loss_and_gradients(monkeypatch):
    from model import modeling_minimind

    ids = torch.randint(3, 97, (3, 11))
    labels = ids.clone()
    labels[0, :5] = -100
    labels[2, 7:] = -100
    results = []
    for path in ("full logits", "unchunked", "chunked"):
        model = tiny_model().train()
        model.chunk_lm_loss = path == "chunked"
        if path == "chunked":  # 3 tokens x 97 logits per chunk: 7 chunks, the last one partial
            monkeypatch.setattr(modeling_minimind, "LOSS_CHUNK_ELEMENTS", 3 * 97)
            assert model.loss_chunk_tokens() == 3
        out = model(ids, labels=labels, num_items_in_batch=19, skip_logits=path != "full logits")
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    full_loss, full_grads = results[0]
    for loss, grads in results[1:]:
        assert torch.allclose(loss, full_loss, atol=1e-6, rtol=0)
        for name, grad in full_grads.items():
            assert torch.allclose(grads[name], grad, atol=1e-6, rtol=0), name
    # the function itself, with one chunk, several and a chunk larger than the input
    hidden, weight = torch.randn(20, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (20,))
    reference = F_cross_entropy_sum(hidden @ weight.t(), targets)
    ref_grads = torch.autograd.grad(reference, (hidden, weight))
    for chunk in (1, 7, 20, 64):
        total = modeling_minimind.chunked_lm_loss(hidden, weight, targets, chunk)
        grads = torch.autograd.grad(total * 0.5, (hidden, weight))
        assert torch.allclose(total, reference, atol=1e-5, rtol=1e-6)
        for grad, ref in zip(grads, ref_grads):
            assert torch.allclose(grad, 0.5 * ref, atol=1e-6, rtol=0)


def F_cross_entropy_sum(logits, targets):
    return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")


def test_forward_uses_the_collators_loss_positions_and_packed_layout_and_computes_none_itself(monkeypatch):
    from dataset import SFTCollator
    from model import modeling_minimind
    from model.packed_attention import PackedDocuments

    ids, positions = packed_rows([[5, 9, 3], [12, 4]], row_len=20)
    labels = torch.where(positions == 0, -100, ids)  # no loss on a document's first token
    items = [{"input_ids": ids[r, :n].numpy(), "labels": labels[r, :n].numpy(), "position_ids": positions[r, :n].numpy()}
             for r, n in enumerate((17, 16))]
    batch = SFTCollator(pad_token_id=0)(items)
    assert batch["input_ids"].shape == (2, 17)  # row 1: 16 tokens and a pad
    expected_positions = [17 * r + t for r in range(2) for t in range(16) if batch["labels"][r, t + 1] != -100]
    assert batch["loss_positions"].tolist() == expected_positions
    layout = batch["packed_layout"]
    assert layout.cu_seqlens.tolist() == [0, 5, 14, 17, 29, 33, 34]
    assert layout.max_length == 12 and layout.shape == (2, 17)

    model = tiny_model().train()
    plain = model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"], skip_logits=True)
    plain.loss.backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    def computed_here(*args, **kwargs):
        raise AssertionError("the model computed what the collator had given it")

    monkeypatch.setattr(modeling_minimind, "loss_positions_of", computed_here)
    monkeypatch.setattr(PackedDocuments, "from_position_ids", computed_here)
    given = model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"], skip_logits=True,
                  loss_positions=batch["loss_positions"], packed_layout=batch["packed_layout"])
    given.loss.backward()
    assert torch.equal(given.loss, plain.loss)
    for grad, plain_grad in zip([p.grad for p in model.parameters()], plain_grads):
        assert torch.allclose(grad, plain_grad, atol=1e-7, rtol=0)
    # the given positions are what the loss uses: the first half of them gives another loss
    half = batch["loss_positions"][: len(expected_positions) // 2]
    partial = model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"], skip_logits=True,
                    loss_positions=half, packed_layout=batch["packed_layout"]).loss
    assert not torch.allclose(partial, plain.loss)


def reference_chunks(hidden, weight, targets, chunk_tokens, grad_total):
    """The loss and its gradients through an fp32 copy of every chunk's logits and torch.logsumexp."""
    total, log_norms = torch.zeros(()), []
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros(weight.shape)
    for start in range(0, len(hidden), chunk_tokens):
        chunk, chunk_targets = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens, None]
        logits = (chunk @ weight.t()).float()
        norms = logits.logsumexp(dim=-1)
        log_norms.append(norms)
        total += (norms - logits.gather(1, chunk_targets).squeeze(1)).sum()
        grad_logits = (logits - norms[:, None]).exp()
        grad_logits.scatter_add_(1, chunk_targets, grad_logits.new_full((len(chunk), 1), -1.0))
        grad_logits = (grad_logits * grad_total).to(hidden.dtype)
        grad_hidden[start:start + chunk_tokens] = grad_logits @ weight
        grad_weight += (grad_logits.t() @ chunk).float()
    return total, torch.cat(log_norms), grad_hidden, grad_weight.to(weight.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_loss_chunks_equal_an_fp32_copy_of_the_logits_bit_for_bit(dtype):
    """The chunks read the logits in the compute dtype and write fp32 in the same pass, where an
    fp32 copy of them came first: the same loss, log-sum-exps and gradients, bit for bit."""
    from model.loss import lm_loss_chunks, lm_loss_gradient_chunks

    generator = torch.Generator().manual_seed(3)
    hidden = (torch.randn(37, 24, generator=generator) * 2).to(dtype)
    weight = torch.randn(301, 24, generator=generator).to(dtype)
    targets = torch.randint(0, 301, (37,), generator=generator)
    grad_total = torch.tensor(0.37)
    expected = reference_chunks(hidden, weight, targets, 8, grad_total)
    total, log_norms, _ = lm_loss_chunks(hidden, weight, targets, 8, False)
    grads = lm_loss_gradient_chunks(grad_total, hidden, weight, targets, log_norms, 8)
    for got, want in zip((total, log_norms, *grads), expected):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_log_sum_exp_of_rows_with_infinities_and_nans_is_torchs():
    from model.loss import log_sum_exp

    inf, nan = float("inf"), float("nan")
    rows = torch.tensor([[1.0, 2.0, 3.0], [inf, 0.0, 1.0], [-inf, -inf, -inf], [nan, 1.0, 2.0], [-inf, 0.5, 2.0]])
    for dtype in (torch.bfloat16, torch.float32):
        got, want = log_sum_exp(rows.to(dtype)), rows.to(dtype).float().logsumexp(-1)
        assert got.dtype == torch.float32 and torch.equal(got.nan_to_num(nan=7.0), want.nan_to_num(nan=7.0))
        assert torch.equal(got.isnan(), want.isnan())


def test_the_loss_moves_22_bytes_per_bf16_logit_forward_and_28_backward():
    """Per logit of a bf16 chunk, counted on the custom ops as the GPU step runs them: forward the
    GEMM's write (2), the row maximum's read (2), one subtraction from bf16 to fp32 (6), exp in place
    (8), the sum's read (4); backward the GEMM's write and the two GEMMs' reads (6), the subtraction
    (6), exp (8), the product with the output's gradient written in bf16 (6). An fp32 copy of the
    logits and torch.logsumexp move 32 and 44. The rest is the weight-sized terms (here 1/16 of a
    weight element per logit): about 0.1 forward, 1.6 backward (the fp32 sum of the weight's gradient)."""
    from model.loss import lm_loss_backward, lm_loss_forward
    from scripts._step_bytes import ByteCounter

    tokens, hidden_size, vocab = 64, 4, 100_000
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=generator).bfloat16()
    weight = torch.randn(vocab, hidden_size, generator=generator).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    with ByteCounter() as forward:
        _total, log_norms, _ = lm_loss_forward(hidden, weight, targets, tokens, False)
    with ByteCounter() as backward:
        lm_loss_backward(torch.tensor(0.5), hidden, weight, targets, log_norms, tokens)
    logits = tokens * vocab
    assert round(forward.total.bytes / logits, 1) == 22.1
    assert round(backward.total.bytes / logits, 1) == 27.6


class Casts(TorchDispatchMode):
    """The shapes of every fp32 tensor that a cast (`aten._to_copy`) makes."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.float32:
            self.shapes.append(tuple(out.shape))
        return out


def test_the_weight_gradient_sums_each_bf16_chunk_in_fp32_without_an_fp32_copy_of_it():
    """Each chunk's weight gradient, a GEMM in the compute dtype, is added into the fp32 sum as it
    is: no fp32 copy of a [V, H] matrix per chunk (8 bytes per weight element per chunk less)."""
    from model.loss import lm_loss_chunks, lm_loss_gradient_chunks

    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, 32, generator=generator).bfloat16()
    weight = torch.randn(10, 32, generator=generator).bfloat16()
    targets = torch.randint(0, 10, (64,), generator=generator)
    _total, log_norms, _ = lm_loss_chunks(hidden, weight, targets, 16, False)
    with Casts() as casts:  # the op's own steps: a dispatch mode sees a custom op as one call
        _grad_hidden, grad_weight = lm_loss_gradient_chunks(torch.tensor(0.5), hidden, weight, targets, log_norms, 16)
    assert (10, 32) not in casts.shapes and grad_weight.dtype == torch.bfloat16


def test_the_losses_of_a_chunk_without_gradients_cast_its_logits_once():
    """Evaluation's chunks with per-token losses: one fp32 copy of a chunk's bf16 logits serves the
    sum and the per-token values."""
    from model.loss import head_loss_in_chunks

    generator = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(8, 50, bias=False).bfloat16()
    hidden = torch.randn(12, 8, generator=generator).bfloat16()
    targets = torch.randint(0, 50, (12,), generator=generator)
    with torch.no_grad(), Casts() as casts:
        total, per_token = head_loss_in_chunks(head, hidden, targets, 5, token_losses=True)
    assert [shape for shape in casts.shapes if shape[-1] == 50] == [(5, 50), (5, 50), (2, 50)]
    assert total.item() == pytest.approx(per_token.sum().item(), rel=1e-6)


def test_without_gradients_the_head_runs_once_per_chunk_of_loss_positions(monkeypatch):
    """Evaluation's forward (no_grad) calls the head on `loss_chunk_tokens()` loss positions at a
    time, as training's loss holds them: the loss equals one call's within float rounding, the
    per-token losses equal it exactly, and a batch of one chunk is that one call, bit for bit."""
    import torch.nn.functional as F

    from model import modeling_minimind

    model = tiny_model()
    ids = torch.randint(3, 97, (3, 11), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :5] = -100
    labels[2, 7:] = -100  # 22 loss positions
    rows = []
    model.lm_head.register_forward_hook(lambda _module, _inputs, logits: rows.append(tuple(logits.shape)))

    def forward(batch_labels):
        rows.clear()
        with torch.no_grad():
            out = model(ids, labels=batch_labels, num_items_in_batch=22, skip_logits=True, return_token_losses=True)
        return out.loss, out.token_losses, list(rows)

    loss, token_losses, calls = forward(labels)
    assert calls == [(22, 97)]  # within one chunk
    chosen = model.model(ids)[0].reshape(-1, 64)[modeling_minimind.loss_positions_of(labels)]
    targets = labels[:, 1:][labels[:, 1:] != -100]
    logits = model.lm_head(chosen).detach()
    assert torch.equal(loss, F.cross_entropy(logits.float(), targets, reduction="sum") / 22)
    assert torch.equal(token_losses, F.cross_entropy(logits.float(), targets, reduction="none"))

    monkeypatch.setattr(modeling_minimind, "LOSS_CHUNK_ELEMENTS", 4 * 97)  # 4 loss positions per chunk
    chunked_loss, chunked_token_losses, chunked_calls = forward(labels)
    assert chunked_calls == [(4, 97)] * 5 + [(2, 97)]
    assert torch.allclose(chunked_loss, loss, atol=1e-6, rtol=0)
    assert torch.equal(chunked_token_losses, token_losses)
    # no loss position: one call on none of them, and a loss tensor of 0
    empty_loss, empty_token_losses, empty_calls = forward(torch.full_like(labels, -100))
    assert empty_calls == [(0, 97)]
    assert torch.equal(empty_loss, torch.tensor(0.0)) and empty_token_losses.shape == (0,)
