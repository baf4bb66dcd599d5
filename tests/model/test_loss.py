"""model/loss.py and the model's loss: shifted cross-entropy by hand, chunked, from the collator's positions."""

import pytest
import torch

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
