"""An evaluation reads one device value on the host: the reduced sums, once, at its end. Its loss
batches, the padding forwards included, read none (trainer/evaluation/evaluate.py).

`scripts/_host_reads.py` marks what would be on the GPU (the model's tensors, and here what
`model_inputs` moves to the device) and records every host read of a marked tensor and every op
on one whose result is sized by its values. The GPU version, with
torch.cuda.set_sync_debug_mode("error"), is in tests/test_cuda.py."""

import re
from types import SimpleNamespace

import torch

import trainer.evaluation.evaluate as evaluation
from dataset import SFTCollator
from scripts._host_reads import HostReads
from tests.helpers.tiny_model import packed_rows, tiny_model
from tests.trainer.loop.test_loop_syncs import micro_batches
from trainer.evaluation.evaluate import EvalSet, evaluate


def packed_batch() -> dict:
    ids, positions = packed_rows([[5, 9, 3], [12, 4]], row_len=32)
    labels = torch.where(positions == 0, -100, ids)
    rows = [{"input_ids": ids[row, :n].numpy(), "labels": labels[row, :n].numpy(),
             "position_ids": positions[row, :n].numpy()} for row, n in enumerate((17, 16))]
    return SFTCollator(pad_token_id=0)(rows)


def eval_run(padding_forwards: int) -> SimpleNamespace:
    """Two held-out files: two padded batches (plus `padding_forwards` forwards without loss
    tokens, as a rank with a shorter slice runs them) and one batch of packed rows."""
    batches = micro_batches(0)
    eval_sets = [EvalSet("plain", batches, len(batches) + padding_forwards), EvalSet("packed", [packed_batch()], 1)]
    return SimpleNamespace(raw_model=tiny_model(), ctx=SimpleNamespace(device=torch.device("cpu")),
                           dtype=torch.float32, args=SimpleNamespace(), tokenizer=None, eval_sets=eval_sets)


def test_an_evaluation_reads_the_device_once_and_its_padding_forwards_add_nothing(monkeypatch):
    run = eval_run(padding_forwards=2)
    guard = HostReads(run.raw_model)
    original = evaluation.model_inputs

    def on_the_device(batch, device):
        inputs = original(batch, device)
        for value in inputs.values():
            guard.mark(value.cu_seqlens if hasattr(value, "cu_seqlens") else value)
        return inputs

    monkeypatch.setattr(evaluation, "model_inputs", on_the_device)
    figures = {}
    reads = guard.during(lambda: figures.update(evaluate(run)))
    assert len(reads) == 1 and re.fullmatch(r"tolist at trainer/evaluation/evaluate\.py:\d+ in evaluate", reads[0]), "\n".join(reads)
    # the figures of the same batches without padding forwards, bit for bit
    assert figures == evaluate(eval_run(padding_forwards=0))
    loss_tokens = [sum(int((b["labels"][:, 1:] != -100).sum()) for b in s.loader) for s in run.eval_sets]
    assert (figures["eval_loss_tokens/plain"], figures["eval_loss_tokens/packed"]) == tuple(loss_tokens)
