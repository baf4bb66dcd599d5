"""What is written from a GPU and read back: checkpoints, inference weights, the generator state
(collected by tests/test_cuda.py)."""

import torch

from tests.cuda.host_syncs import without_host_sync


def test_a_background_save_queues_its_copies_and_writes_the_state_of_its_step(tmp_path, monkeypatch):
    """trainer/loop/saves.py on the GPU: the save's copies to pinned memory and its hand-off to the
    writer read nothing on the host (the checkpoint's content comes from `saving_run`'s stand-in for
    resume_state: weights and optimizer state), the loop changes the weights in place while the
    writer waits, and the files hold the weights of the saved step, the tied embedding once: one
    host copy for both its names (`same_memory_key` of the GPU's storage)
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
    assert run.raw_model.config.tie_word_embeddings
    head, embedding = saved["model"]["lm_head.weight"], saved["model"]["model.embed_tokens.weight"]
    assert head.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()


def test_the_host_copies_of_a_gpu_state_are_page_locked_in_one_block_of_their_size():
    """trainer/checkpoint/host_memory.py: the copies lie end to end in one block registered with
    the driver (queued copies, not waited for), not each in a power-of-two block of torch's pinned
    allocator; the block is unregistered when its copies are freed (registering the same addresses
    again would fail)."""
    import gc

    from trainer.checkpoint.background import to_host

    state = {"a": torch.randn(1000, device="cuda:0"), "b": torch.randn(3, 7, device="cuda:0")}
    for _ in range(3):
        copy = to_host(state)
        torch.cuda.synchronize()
        assert all(value.is_pinned() for value in copy.values())
        assert copy["b"].untyped_storage().data_ptr() - copy["a"].untyped_storage().data_ptr() == 4032
        assert all(torch.equal(copy[key], state[key].cpu()) for key in state)
        del copy
        gc.collect()


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


def test_a_model_for_loaded_weights_is_allocated_on_the_gpu_with_the_bits_of_one_moved_there(tmp_path):
    """trainer/weights/inference.py `empty_model` on cuda:0 (--from_weight and a resume: `build_model`;
    chat.py / eval_sft.py --device cuda: `load_model_for_inference`): built on the meta device and
    allocated on the GPU in the dtype asked for, never initialised at random nor a float32 model on
    the host; RoPE tables computed on the host in float32; the head tied. Its weights and logits are,
    bit for bit, those of the same model built on the host and moved (and cast) with `.to`
    (tests/trainer/weights/test_build_from_weights.py is the CPU version)."""
    from types import SimpleNamespace

    from tests.helpers.tiny_model import tiny_model
    from tests.trainer.weights.test_build_from_weights import Made, parameter_bytes, weights_of
    from trainer.model_setup import build_model
    from trainer.weights.inference import load_model_for_inference

    device, args, source = torch.device("cuda:0"), SimpleNamespace(gradient_checkpointing=0), tiny_model()
    path = tmp_path / "step_00000001.pt"
    torch.save({"format": "minisft-resume", "format_version": 1, "model_config": source.config.to_dict(),
                "model": source.state_dict()}, path)
    weights, made = weights_of(source), Made()
    with made:
        trained = build_model(args, source.config, device, weights)
        resumed = build_model(args, source.config, device, resumed=True)
    assert made.random_fills == [] and made.bytes.get(("cpu", torch.float32), 0) < parameter_bytes(source) / 4
    chat = load_model_for_inference(path, device="cuda", dtype=torch.bfloat16)
    moved = tiny_model().to(device)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0)).to(device)
    for model, dtype in ((trained, torch.float32), (resumed, torch.float32), (chat, torch.bfloat16)):
        assert {(p.device, p.dtype) for p in model.parameters()} == {(device, dtype)}
        assert model.lm_head.weight is model.model.embed_tokens.weight
        for name in ("freqs_cos", "freqs_sin"):
            table = getattr(model.model, name)
            assert table.dtype == torch.float32 and torch.equal(table, getattr(moved.model, name)), name
    with torch.no_grad():
        for model, dtype in ((trained, torch.float32), (chat, torch.bfloat16)):
            expected = moved.to(dtype)  # in place: float32 first, then bfloat16
            state = model.state_dict()
            assert all(torch.equal(state[key], value) for key, value in expected.state_dict().items())
            assert torch.equal(model(ids).logits, expected(ids).logits), dtype


def test_the_minimind_pth_of_a_model_on_the_gpu_loads_onto_the_host(tmp_path):
    """trainer/weights/write.py `write_minimind_pth` (--save_weight, export_hf.py --format minimind) of a
    model on the GPU: every tensor of the file loads onto the host, not onto the GPU it came from (which
    a machine without that GPU could not load), each the weight in float16 bit for bit, the tied head
    among them (tests/trainer/weights/test_minimind_pth.py is the CPU version)."""
    from tests.helpers.tiny_model import tiny_model
    from trainer.weights.write import write_minimind_pth

    model = tiny_model().to("cuda:0")
    write_minimind_pth(model, str(tmp_path / "full_sft_64.pth"))
    saved, state = torch.load(tmp_path / "full_sft_64.pth", weights_only=True), model.state_dict()
    assert sorted(saved) == sorted(state)
    for key, value in saved.items():
        assert value.device.type == "cpu" and torch.equal(value, state[key].to(torch.float16).cpu()), key
