"""What the loop runs between its reads on the host, on the GPU: no synchronizing call, checked with
torch.cuda.set_sync_debug_mode("error") (`without_host_sync`; collected by tests/test_cuda.py)."""

import pytest
import torch


def without_host_sync(action):
    """`action()` under torch.cuda.set_sync_debug_mode("error"): a host sync inside raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return action()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("kind", ["dense", "packed", "moe", "mixture"])
def test_a_training_micro_step_makes_no_host_sync(kind):
    """Forward + backward of one micro-batch as trainer/loop.optimizer_step runs it (bf16 autocast,
    the collator's precomputed loss positions and packed layout, pinned as the loader pins them;
    for a mixture the per-source losses of trainer/loop/source_losses.py): any host sync raises."""
    from dataset import SFTCollator
    from tests.helpers.tiny_model import packed_rows, tiny_model
    from dataset import model_inputs
    from trainer.loop.source_losses import SourceLosses
    from torch.utils.data._utils.pin_memory import pin_memory

    if kind == "moe" and torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("F.grouped_mm's kernel serves bf16 on compute capability 9.x/10.x only; elsewhere torch's "
                    "fallback (_grouped_mm_fallback) copies the group ends to the host, a sync")
    model = tiny_model(**(dict(use_moe=True, num_experts=4, num_experts_per_tok=2) if kind == "moe" else {}))
    model = model.cuda().train()
    lengths = [[5, 9, 3], [12, 4], [30]] if kind == "packed" else [[17], [16], [30]]
    ids, positions = packed_rows(lengths, row_len=32)
    labels = torch.where(positions == 0, -100, ids)
    items = []
    for row, documents in enumerate(lengths):
        n = sum(documents)
        item = {"input_ids": ids[row, :n].numpy(), "labels": labels[row, :n].numpy()}
        if kind == "packed":
            item["position_ids"] = positions[row, :n].numpy()
        if kind == "mixture":
            item["source"] = row % 2
        items.append(item)
    batch = pin_memory(SFTCollator(pad_token_id=0)(items))  # as the trainer's loader hands it over
    if kind == "packed":
        assert batch["packed_layout"].cu_seqlens.is_pinned()
    loss_tokens = int((batch["labels"][:, 1:] != -100).sum())
    sources = SourceLosses(["a", "b"], torch.device("cuda:0")) if kind == "mixture" else None

    def micro_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):  # bf16: the grouped kernel's only dtype
            out = model(**model_inputs(batch, torch.device("cuda:0")), num_items_in_batch=loss_tokens,
                        num_sequences_in_batch=len(items), skip_logits=True,
                        **({"return_token_losses": True} if sources else {}))
        (out.loss + out.aux_loss).backward()
        if sources:
            sources.add_micro_batch(out.token_losses, batch)
        return out

    micro_step()  # CUDA/cuBLAS initialisation may synchronise once
    out = without_host_sync(micro_step)
    assert torch.isfinite(out.loss).item()


def test_steps_between_log_lines_make_no_host_sync():
    """trainer/loop.take_step on the GPU (two micro-batches, the counts agreed from the CPU batches,
    clipping, fused AdamW skipping a NaN step on the device, the flags queued): no synchronizing call
    in a step between log lines; the log line then reads them (tests/trainer/loop/test_loop_syncs.py
    is the CPU version)."""
    from tests.trainer.loop.test_loop_syncs import micro_batches, new_interval, poisoned, snapshot, tiny_run
    from trainer.loop.loop import log_interval, take_step

    run = tiny_run(torch.device("cuda:0"))
    interval = new_interval(run)
    take_step(run, micro_batches(0), interval, 1e-3)  # CUDA/cuBLAS initialisation, AdamW's state

    def three_steps():
        take_step(run, micro_batches(1), interval, 1e-3)
        with poisoned(run):
            take_step(run, micro_batches(2), interval, 1e-3)
        take_step(run, micro_batches(3), interval, 1e-3)

    without_host_sync(three_steps)
    before = snapshot(run)
    with poisoned(run):
        take_step(run, micro_batches(4), interval, 1e-3)
    after = snapshot(run)
    assert all(torch.equal(before[key], after[key]) for key in before)  # a skipped step changes nothing
    log_interval(run, interval, torch.zeros((), device="cuda:0"), 1e-3, 10)
    assert run.state.skipped_steps == 2 and run.logger.rows[-1][1]["skipped_steps"] == 2


def test_the_loss_batches_of_an_evaluation_make_no_host_sync():
    """trainer/evaluation's loss and token-accuracy sums on the GPU (padded and packed batches, two
    padding forwards as a rank with a shorter slice runs them, bf16 autocast): no synchronizing
    call; the sums are read once afterwards (tests/trainer/evaluation/test_evaluation_syncs.py is
    the CPU version)."""
    from tests.trainer.evaluation.test_evaluation_syncs import eval_run
    from trainer.evaluation.evaluate import loss_and_accuracy_sums

    run = eval_run(padding_forwards=2)
    device = torch.device("cuda:0")
    model = run.raw_model.to(device)

    @torch.no_grad()
    def sums():
        return torch.stack([loss_and_accuracy_sums(model, eval_set.loader, device, torch.bfloat16, eval_set.forwards)
                            for eval_set in run.eval_sets])

    first = sums()  # CUDA/cuBLAS initialisation may synchronise once
    again = without_host_sync(sums)
    assert torch.equal(again, first)
    loss_tokens = [sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in s.loader) for s in run.eval_sets]
    assert again[:, 1].tolist() == loss_tokens and torch.isfinite(again).all().item()


def test_a_collapsed_fp16_loss_scale_restarts_at_the_next_finite_step_without_a_host_sync():
    """trainer/runtime/precision.py `restart_collapsed_scale` on the GPU (fp16 autocast, the GradScaler
    and fused AdamW): overflowing steps halve a scale below 1 and keep it there, and the next finite
    step restarts it at 65536 with its growth tracker at 0, on the device, between log lines
    (tests/trainer/loop/test_loss_scale.py is the CPU version)."""
    from tests.trainer.loop.test_loop_syncs import micro_batches, new_interval, poisoned, snapshot, tiny_run
    from trainer.loop.loop import take_step
    from trainer.runtime.precision import INITIAL_LOSS_SCALE

    run = tiny_run(torch.device("cuda:0"), dtype=torch.float16, max_bad_steps=10)  # 3 bad steps: no stop
    interval = new_interval(run)
    take_step(run, micro_batches(0), interval, 1e-3)  # CUDA/cuBLAS initialisation, AdamW's state
    run.scaler.update(1.0)  # as after 16 overflowing steps

    def overflowing_steps():
        with poisoned(run):
            for seed in (1, 2, 3):
                take_step(run, micro_batches(seed), interval, 1e-3)

    without_host_sync(overflowing_steps)
    assert run.scaler.get_scale() == 0.125
    before = snapshot(run)["w.model.embed_tokens.weight"]
    without_host_sync(lambda: take_step(run, micro_batches(4), interval, 1e-3))
    assert run.scaler.get_scale() == INITIAL_LOSS_SCALE and run.scaler.state_dict()["_growth_tracker"] == 0
    assert not torch.equal(snapshot(run)["w.model.embed_tokens.weight"], before)
