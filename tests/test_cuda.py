"""The CUDA paths (cuda autocast, the fp16 GradScaler, NCCL). The suite hides the GPUs from every
other test (tests/conftest.py); these run on their own, in one process, with the GPUs shown:

    python -m pytest tests/test_cuda.py --gpus -n 0

Without --gpus, or on a machine without a GPU (CI), they are skipped."""

import functools

import pytest
import torch

from tests.helpers.trainer_launch import final_weights, flags, run_trainer, train_losses

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU, shown to the tests: python -m pytest tests/test_cuda.py --gpus -n 0"),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_gpu_trains_with_autocast_and_grad_scaler(data, tmp_path, dtype):
    args = flags(data, tmp_path, "--batch_size", "8", "--max_steps", "4", "--dtype", dtype, "--device", "cuda")
    result = run_trainer(args)
    assert "device cuda:0" in result.stdout
    losses = train_losses(tmp_path)
    assert losses[4] < losses[1]
    assert all(torch.isfinite(w).all() for w in final_weights(tmp_path).values())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_with_nccl_equal_one_gpu_with_double_batch(data, tmp_path):
    common = ["--max_steps", "3", "--dtype", "float32", "--save_interval", "0"]
    run_trainer(flags(data, tmp_path / "two", "--batch_size", "4", "--backend", "nccl", *common), nproc=2)
    run_trainer(flags(data, tmp_path / "one", "--batch_size", "8", *common))
    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-4), key


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_two_gloo_ranks_on_one_gpu_equal_one_process_with_double_batch(data, tmp_path, dtype, atol):
    """DDP over gloo with both ranks on cuda:0 (NCCL refuses two ranks on one GPU), two micro-batches
    each (no_sync on the first): the weights of 1 process x 2B, within the dtype's rounding."""
    common = ["--max_steps", "3", "--dtype", dtype, "--save_interval", "0", "--device", "cuda:0",
              "--accumulation_steps", "2"]
    run_trainer(flags(data, tmp_path / "two", "--batch_size", "2", "--backend", "gloo", *common), nproc=2)
    run_trainer(flags(data, tmp_path / "one", "--batch_size", "4", *common))
    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    for key in one:
        assert torch.allclose(one[key], two[key], atol=atol), key


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0),
                    reason="FlashAttention's varlen kernel needs sm80 or newer")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_kernel_and_bucketed_sdpa_agree_on_packed_rows(dtype):
    from model import packed_attention
    from tests.helpers.tiny_model import packed_rows, tiny_model

    ids, positions = packed_rows([[1, 2, 3, 9, 17, 5], [40], [33, 2, 1, 1]], row_len=40)
    ids, positions = ids.cuda(), positions.cuda()
    results, varlen_calls = {}, []
    original = packed_attention.varlen_attn
    assert original is not None, "this torch has no varlen_attn"

    @functools.wraps(original)  # the signature of the installed varlen_attn, whose keywords are read
    def counted_varlen_attn(*args, **kwargs):
        varlen_calls.append(args[0].shape)
        return original(*args, **kwargs)

    for path in ("varlen", "buckets"):
        model = tiny_model().cuda().train()
        # "buckets": no varlen kernel, which forces the bucketed SDPA path
        packed_attention.varlen_attn = counted_varlen_attn if path == "varlen" else None
        try:
            with torch.autocast("cuda", dtype=dtype):
                out = model(ids, position_ids=positions, labels=ids)
            out.loss.backward()
        finally:
            packed_attention.varlen_attn = original
        results[path] = (out.loss.float(), [p.grad.float() for p in model.parameters()])
    assert len(varlen_calls) == model.config.num_hidden_layers  # the varlen kernel ran, once per layer
    (varlen_loss, varlen_grads), (bucket_loss, bucket_grads) = results["varlen"], results["buckets"]
    assert torch.allclose(varlen_loss, bucket_loss, rtol=1e-2)
    for a, b in zip(varlen_grads, bucket_grads):
        assert torch.allclose(a, b, atol=2e-2, rtol=5e-2)


@pytest.mark.parametrize("packed", [False, True])
def test_gqa_in_float32_never_reaches_the_math_kernel(packed):
    """Where FlashAttention cannot run (float32 here; fp16 on a pre-Ampere GPU), SDPA runs GQA
    only in its math kernel ([B, H, T, T] scores): with it excluded, a training step still runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.helpers.tiny_model import packed_rows, tiny_model

    ids, positions = packed_rows([[1, 2, 3, 9, 17, 5], [40], [33, 2, 1, 1]], row_len=40)
    inputs = dict(position_ids=positions.cuda()) if packed else {}
    model = tiny_model().cuda().train()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = model(ids.cuda(), labels=ids.cuda(), **inputs)
        out.loss.backward()
    assert torch.isfinite(out.loss)


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


def without_host_sync(action):
    """`action()` under torch.cuda.set_sync_debug_mode("error"): a host sync inside raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return action()
    finally:
        torch.cuda.set_sync_debug_mode("default")


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


def test_the_norm_is_one_fused_kernel_each_way_and_agrees_with_the_cpu_closed_form():
    """model/rms_norm.py on a GPU: ATen's fused RMSNorm forward and backward, one op each, in bf16,
    with gradients equal to the CPU path's closed form within bf16 rounding."""
    from model.rms_norm import rms_norm
    from scripts._dispatch_counts import DispatchCounter

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 768, generator=generator)
    weight, grad = 1 + 0.1 * torch.randn(768, generator=generator), torch.randn(4, 64, 768, generator=generator)
    results = {}
    for device in ("cuda", "cpu"):
        leaves = [t.to(device, torch.bfloat16).requires_grad_() for t in (x, weight)]
        out_grad = grad.to(device, torch.bfloat16)
        with DispatchCounter() as counter:
            out = rms_norm(*leaves, 1e-6)
            out.backward(out_grad)
        results[device] = [t.float().cpu() for t in (out, leaves[0].grad, leaves[1].grad)]
        if device == "cuda":
            assert out.dtype == torch.bfloat16
            assert {str(op) for op in counter.ops if "rms_norm" in str(op)} == {
                "aten._fused_rms_norm.default", "aten._fused_rms_norm_backward.default"}
            assert counter.total <= 4, dict(counter.ops)
    for gpu, cpu in zip(results["cuda"], results["cpu"]):
        assert torch.allclose(gpu, cpu, rtol=5e-2, atol=5e-2 * cpu.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_writes_the_gradient_autograd_computes_bit_for_bit(dtype):
    """model/feed_forward.py's swiglu writes its gradient's halves through `out=` into one strided
    buffer: on the GPU's kernels too the values are autograd's for silu(gate) * up, for a plain GEMM
    output and for a transposed one (non-contiguous halves)."""
    from model.feed_forward import swiglu

    generator = torch.Generator(device="cuda").manual_seed(0)
    for joined in (torch.randn(64, 96, device="cuda", generator=generator),
                   torch.randn(96, 64, device="cuda", generator=generator).t()):
        joined = joined.to(dtype).requires_grad_()
        reference = joined.detach().clone().requires_grad_()
        grad = torch.randn(64, 48, device="cuda", generator=generator).to(dtype)
        swiglu(joined).backward(grad)
        gate, up = reference.chunk(2, dim=-1)
        (torch.nn.functional.silu(gate) * up).backward(grad)
        assert torch.equal(joined.grad, reference.grad)


def test_a_background_save_queues_its_copies_and_writes_the_state_of_its_step(tmp_path, monkeypatch):
    """trainer/loop/saves.py on the GPU: the save's copies to pinned memory and its hand-off to the
    writer read nothing on the host (the checkpoint's content comes from `saving_run`'s stand-in for
    resume_state: weights and optimizer state), the loop changes the weights in place while the
    writer waits, and the files hold the weights of the saved step
    (tests/trainer/checkpoint/test_background.py is the CPU version)."""
    from tests.trainer.checkpoint.test_background import Gate, saving_run, step
    from tests.trainer.loop.test_loop_syncs import micro_batches
    from trainer.checkpoint.save_dir import checkpoint_path
    from trainer.loop import saves

    gate = Gate()
    run = saving_run(tmp_path, monkeypatch, gate, torch.device("cuda:0"))
    step(run, micro_batches(0), 1e-3)
    at_save = {key: value.detach().cpu() for key, value in run.raw_model.state_dict().items()}

    def save_then_step():
        saves.save_in_background(run)
        step(run, micro_batches(1), 1e-3)  # queued behind the save's copies; changes the weights in place

    without_host_sync(save_then_step)
    assert not torch.equal(run.raw_model.model.embed_tokens.weight.cpu(), at_save["model.embed_tokens.weight"])
    gate.released.set()
    saves.finish_saves(run)
    saved = torch.load(checkpoint_path(str(tmp_path), 1), weights_only=True)
    for key, value in at_save.items():
        assert torch.equal(saved["model"][key], value), key
        assert torch.equal(gate.calls[0][key], value), key


def test_a_save_casts_one_weight_at_a_time_on_the_gpu(tmp_path, monkeypatch):
    """--save_dtype bfloat16: the save's device memory above what training holds is one weight in
    bf16 (the largest), not a bf16 copy of every weight (trainer/checkpoint/background.py: to_host)."""
    from tests.trainer.checkpoint.test_background import Gate, saving_run, step
    from tests.trainer.loop.test_loop_syncs import micro_batches
    from trainer.loop import saves

    gate = Gate()
    gate.released.set()
    run = saving_run(tmp_path, monkeypatch, gate, torch.device("cuda:0"))
    run.args.save_dtype = "bfloat16"
    step(run, micro_batches(0), 1e-3)
    saves.save_in_background(run)  # the first save allocates the host buffers and builds the copy's model
    saves.finish_saves(run)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    saves.save_in_background(run)
    saves.finish_saves(run)
    largest = max(value.numel() for value in run.raw_model.state_dict().values()) * 2
    every = sum(value.numel() for value in run.raw_model.state_dict().values()) * 2
    assert torch.cuda.max_memory_allocated() - before <= largest + 4096 < every


def test_inference_weights_written_from_the_gpu_cast_one_weight_at_a_time(tmp_path):
    """`<save_dir>/best/` and the exports write the live model: its device memory above the
    weights is one weight in bf16 at a time (trainer/weights/write.py: _inference_state), and the
    file holds the weights cast."""
    from safetensors.torch import load_file

    from tests.helpers.tiny_model import tiny_model
    from trainer.weights.write import write_inference_dir

    model = tiny_model().to("cuda:0")
    state = model.state_dict()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    write_inference_dir(model, str(tmp_path), torch.bfloat16)
    largest = max(value.numel() for value in state.values()) * 2
    assert torch.cuda.max_memory_allocated() - before <= largest + 4096 < sum(v.numel() for v in state.values()) * 2
    written = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(value, state[key].to(torch.bfloat16).cpu()) for key, value in written.items())


def test_the_gpu_generator_state_goes_through_a_checkpoint_file_and_back(tmp_path):
    """trainer/runtime/seeding.py on the GPU: this device's generator state, saved as a resume
    checkpoint holds it (read back with weights_only) and restored, draws the same numbers again."""
    from trainer.runtime.seeding import capture_rng_state, restore_rng_state, setup_seed

    device = torch.device("cuda:0")
    setup_seed(7)
    torch.rand(5, device=device)  # the state moves away from the seed's
    torch.save({"rng": capture_rng_state(device)}, tmp_path / "state.pt")
    first = (torch.rand(64, device=device), torch.nn.functional.dropout(torch.ones(64, device=device), 0.5))
    restore_rng_state(torch.load(tmp_path / "state.pt", weights_only=True)["rng"], device)
    again = (torch.rand(64, device=device), torch.nn.functional.dropout(torch.ones(64, device=device), 0.5))
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_a_step_out_of_gpu_memory_is_one_line_naming_the_flags(data, tmp_path):
    """GPU 0 capped at 16 MiB (tests/helpers/faults.py): the tiny model fits, a step's LM-loss chunk
    (4,096 tokens x 6,400 logits) does not: the caching allocator's OutOfMemoryError, in one line."""
    import os

    from tests.helpers.trainer_launch import REPO, clean_env

    faulty = os.path.join(REPO, "tests", "helpers", "faults.py")
    result = run_trainer(flags(data, tmp_path, "--batch_size", "8", "--max_steps", "2", "--device", "cuda"),
                         script=faulty, env=clean_env(MINISFT_FAULT_GPU_MEMORY_MIB="16"), check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 1 ran out of memory on cuda:0 (CUDA out of memory.") and last.endswith(
        "lower --batch_size (raise --accumulation_steps to keep the batch per step), lower --max_seq_len, or give "
        "--gradient_checkpointing 1")


def test_bench_memory_measures_on_the_gpu():
    """scripts/bench_memory.py --device cuda on one GPU: the held bytes are exact, and the
    allocator's peak over the step holds at least them (plus the activations)."""
    from model import MiniMindConfig, MiniMindForCausalLM
    from scripts.bench_memory import run
    from tests.scripts.test_bench_memory import TINY

    with torch.device("meta"):
        parameters = list(MiniMindForCausalLM(MiniMindConfig(**TINY)).parameters())
    numel = sum(p.numel() for p in parameters)
    total, _, computed, measured, peak = run(1, False, TINY, "cuda")
    assert (total, computed, measured) == (numel, 4 * numel * 4, 4 * numel * 4 + len(parameters) * 4)
    assert peak >= measured


def test_the_roofline_join_places_nearly_all_gpu_time_against_an_estimate(data, capsys):
    """scripts/profile_step.py --roofline 1 on a small packed step: the ops whose GPU time finds no
    traced op ("-" rows) hold under 5% of it, and no traced op's ratio is below 0.5 (time joined to
    the wrong op would show there)."""
    from scripts import profile_step

    assert profile_step.main(["--hidden_size", "128", "--num_hidden_layers", "2", "--max_seq_len", "512",
                              "--batch_size", "4", "--mode", "packed", "--steps", "2", "--roofline", "1", "--top", "200",
                              "--data_path", str(data / "train.jsonl"), "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    table = out.split("ops by their own GPU time against the step's roofline estimate, ms per step:\n")[1]
    rows = [line.split() for line in table.splitlines()[1:] if line.startswith("  ") and len(line.split()) >= 4]
    total = float(rows[-1][0])
    unjoined = sum(float(row[0]) for row in rows[:-1] if row[1] == "-")
    assert unjoined < 0.05 * total, table
    assert all(float(row[3]) >= 0.5 for row in rows[:-1] if row[1] != "-"), table


def test_an_moe_layer_of_eight_experts_per_token_gives_the_same_bits_on_every_run():
    """Each token's 8 expert outputs are summed in slot order (model/feed_forward.py), without the
    atomic adds of `index_add_`: two bf16 forward and backward passes agree bit for bit."""
    from model.compute_weights import ComputeWeights, piece_layout
    from tests.helpers.tiny_model import tiny_model

    model = tiny_model(use_moe=True, num_experts=16, num_experts_per_tok=8)
    moe = model.cuda().train().model.layers[0].mlp
    x = torch.randn(4, 64, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    runs = []
    for _ in range(2):
        moe.zero_grad()
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            weights = ComputeWeights(moe, torch.bfloat16, piece_layout(moe, moe.weight_groups()))
            out, balance = moe(x.requires_grad_(), weights)
        (out.float().square().sum() + balance.sum()).backward()
        runs.append([out, x.grad, *(p.grad for p in moe.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0),
                    reason="FlashAttention's varlen kernel needs sm80 or newer")
def test_a_packed_layout_built_on_the_cpu_is_moved_for_the_varlen_kernel():
    from model.packed_attention import PackedDocuments
    from tests.helpers.tiny_model import packed_rows, tiny_model

    ids, positions = packed_rows([[1, 2, 3, 9, 17, 5], [40], [33, 2, 1, 1]], row_len=40)
    model = tiny_model().cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        layout = PackedDocuments.from_position_ids(positions)  # on the CPU
        given = model(ids.cuda(), position_ids=positions.cuda(), packed_layout=layout)
        derived = model(ids.cuda(), position_ids=positions.cuda())
    assert torch.equal(given.logits, derived.logits)
