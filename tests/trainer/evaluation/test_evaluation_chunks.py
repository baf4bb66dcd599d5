"""An evaluation's forward holds the logits of one chunk of loss positions at a time, as training's
loss does (`MiniMindForCausalLM.loss_chunk_tokens`), and its figures are those of one call of the
head on all of them (trainer/evaluation/evaluate.py, model/loss.py `head_loss_in_chunks`)."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from model import modeling_minimind
from tests.helpers.tiny_model import tiny_model
from trainer.evaluation.evaluate import loss_and_accuracy_sums

VOCAB = 97  # tiny_model's


class VocabRows(TorchDispatchMode):
    """The rows of every tensor an op makes with the vocabulary as its last dimension (views left out)."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.rows += [t.numel() // VOCAB for t in tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.dim() > 1 and t.shape[-1] == VOCAB]
        return out


def batch_with_right_answers() -> dict:
    """20 loss positions in two rows, the labels of 7 of them set to the model's own prediction."""
    input_ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        predicted = tiny_model()(input_ids=input_ids).logits[:, :-1].argmax(-1)  # for the token at t + 1
    labels = input_ids.clone()
    labels[0, :3] = -100
    labels[1, :1] = -100
    right = [(0, 3), (0, 4), (0, 9), (1, 1), (1, 2), (1, 6), (1, 11)]
    for row, col in right:
        labels[row, col] = predicted[row, col - 1]
    return {"input_ids": input_ids, "labels": labels}


def sums(batches, alive=None):
    """The evaluation's sums; `alive` gets, at each call of the head, how many earlier calls' logits
    are still held."""
    model, made = tiny_model(), []

    def count_alive(_module, _inputs, logits):
        alive.append(sum(ref() is not None for ref in made))
        made.append(weakref.ref(logits))

    if alive is not None:
        model.lm_head.register_forward_hook(count_alive)
    with torch.no_grad():
        return loss_and_accuracy_sums(model, batches, torch.device("cpu"), torch.float32)


def test_an_evaluation_holds_one_chunk_of_logits_and_sums_as_one_call_does(monkeypatch):
    batches = [batch_with_right_answers()]
    whole = VocabRows()
    with whole:
        expected = sums(batches)
    assert expected[1:].tolist() == [20, 7]
    assert max(whole.rows) == 20  # one chunk: the head on all loss positions of the batch at once
    monkeypatch.setattr(modeling_minimind, "LOSS_CHUNK_ELEMENTS", 4 * VOCAB)  # 4 loss positions per chunk
    chunked, alive = VocabRows(), []
    with chunked:
        got = sums(batches, alive)
    assert max(chunked.rows) == 4
    assert alive == [0] * 5  # each chunk's logits are gone before the next call: the evaluation keeps their argmax
    assert got[0].item() == pytest.approx(expected[0].item(), rel=1e-6)
    assert got[1:].tolist() == [20, 7]
