"""Saves off the critical path (trainer/checkpoint/background.py, trainer/loop/saves.py): the loop
waits only for a host copy of the state; the writer thread writes it; the next save waits for the
previous write; a failed write stops the run at the next save or at the end in one line."""

import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.helpers.trainer_launch import REPO, clean_env, flags, run_trainer
from tests.trainer.loop.test_loop_syncs import micro_batches, new_interval, tiny_run
from trainer.checkpoint.background import BackgroundWriter, copies_done, host_model, same_memory_key, to_host
from trainer.checkpoint.save_dir import checkpoint_path
from trainer.errors import CheckpointError
from trainer.loop import saves
from trainer.loop.loop import take_step



def step(run, batches, lr: float) -> None:
    """One optimizer step as the loop takes it."""
    take_step(run, batches, new_interval(run), lr)

def test_the_host_copy_keeps_the_values_of_its_moment():
    live = {"model": {"w": torch.arange(4.0)}, "optimizer": {"state": {0: {"step": torch.tensor(3.0)}},
                                                             "param_groups": [{"lr": 0.1, "params": [0]}]},
            "rng": [torch.tensor([1, 2], dtype=torch.uint8)], "step": 7}
    copy = to_host(live)
    live["model"]["w"].add_(100)
    live["optimizer"]["state"][0]["step"].add_(1)
    assert torch.equal(copy["model"]["w"], torch.arange(4.0)) and copy["optimizer"]["state"][0]["step"] == 3
    assert copy["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}] and copy["step"] == 7
    assert copy["model"]["w"].data_ptr() != live["model"]["w"].data_ptr()


def test_the_next_job_starts_after_the_previous_one_ends():
    writer, order = BackgroundWriter(), []

    def job(name, seconds):
        def run():
            order.append(f"{name} start")
            time.sleep(seconds)
            order.append(f"{name} end")
        return run

    assert writer.submit(job("a", 0.3)) is None
    assert writer.submit(job("b", 0)) is None  # waits for a
    assert writer.wait() is None
    assert order == ["a start", "a end", "b start", "b end"]


def test_a_failed_write_is_reported_once_and_the_next_job_does_not_start():
    writer, ran = BackgroundWriter(), []

    def failing():
        raise CheckpointError("could not write /x/step_00000004.pt: No space left on device")

    writer.submit(failing)
    assert writer.submit(lambda: ran.append(1)) == "could not write /x/step_00000004.pt: No space left on device"
    assert ran == [] and writer.wait() is None
    writer.submit(lambda: 1 / 0)  # a bug in the writer keeps its traceback
    with pytest.raises(ZeroDivisionError):
        writer.wait()


def test_the_writer_thread_works_on_the_device_of_the_thread_that_submits(monkeypatch):
    """torch.cuda as on a GPU machine, the rank's device 3: the writer thread makes it its own before
    its job (a new thread's current device is GPU 0), so what it asks of CUDA lands on the rank's GPU."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: calls.append(("set_device", device, threading.current_thread().name)))
    writer = BackgroundWriter()
    assert writer.submit(lambda: calls.append(("job", threading.current_thread().name))) is None
    assert writer.wait() is None
    assert calls == [("set_device", 3, "minisft-checkpoint-writer"), ("job", "minisft-checkpoint-writer")]


def test_on_a_gpu_the_writer_reads_the_host_copies_once_the_copies_queued_before_the_save_are_done(monkeypatch):
    """The host copies are queued on the GPU (`to_host`): `copies_done` records an event on the
    submitting thread's stream after them, and the writer thread waits on it before its job reads
    them. A process that has not used CUDA (a CPU run) has nothing to wait for."""
    calls = []

    class Event:
        def record(self):
            calls.append(("record", threading.current_thread().name))

        def synchronize(self):
            calls.append(("synchronize", threading.current_thread().name))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert copies_done() is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    writer = BackgroundWriter()
    assert writer.submit(lambda: calls.append(("job", threading.current_thread().name)), copies_done()) is None
    assert writer.wait() is None
    here = threading.current_thread().name  # the training thread's
    assert calls == [("record", here), ("set_device", 1), ("synchronize", "minisft-checkpoint-writer"),
                     ("job", "minisft-checkpoint-writer")]


class Gate:
    """Stands in for publish_inference_weights: records what it is given, and holds the writer
    thread until released."""

    def __init__(self, fail_with: BaseException | None = None):
        self.released, self.calls, self.models, self.tokenizers = threading.Event(), [], [], []
        self.fail_with = fail_with

    def __call__(self, model, tokenizer, save_dir, dtype):
        self.released.wait(timeout=30)
        self.calls.append({key: value.clone() for key, value in model.state_dict().items()})
        self.models.append(model)
        self.tokenizers.append(tokenizer)
        if self.fail_with:
            raise self.fail_with


def saving_run(tmp_path, monkeypatch, gate, device: torch.device = torch.device("cpu")):
    run = tiny_run(device)
    run.args = SimpleNamespace(**{**vars(run.args), "save_dir": str(tmp_path)}, keep_last=3, save_dtype="float32",
                               save_weight=None)
    run.logger = SimpleNamespace(print=lambda message: None)
    monkeypatch.setattr(saves, "resume_state", lambda run: {
        "step": run.state.step, "model": run.raw_model.state_dict(), "optimizer": run.optimizer.state_dict()})
    monkeypatch.setattr(saves, "publish_inference_weights", gate)
    return run


def test_a_save_returns_before_the_write_and_writes_the_state_of_its_step(tmp_path, monkeypatch):
    gate = Gate()
    run = saving_run(tmp_path, monkeypatch, gate)
    batches = micro_batches()
    step(run, batches, 1e-3)
    at_save = {key: value.clone() for key, value in run.raw_model.state_dict().items()}
    saves.save_in_background(run)
    assert run.writer.thread.is_alive() and not gate.calls  # the loop goes on while the writer writes
    step(run, batches, 1e-3)  # changes the live weights in place
    assert not torch.equal(run.raw_model.model.embed_tokens.weight, at_save["model.embed_tokens.weight"])
    gate.released.set()
    saves.finish_saves(run)
    saved = torch.load(checkpoint_path(str(tmp_path), 1), weights_only=True)
    assert saved["step"] == 1 and saved.keys() >= {"model", "optimizer"}
    for key, value in at_save.items():
        assert torch.equal(saved["model"][key], value), key
        assert torch.equal(gate.calls[0][key], value), key


def test_a_failed_background_write_stops_the_run_at_the_next_save_or_at_the_end(tmp_path, monkeypatch):
    message = f"could not write inference weights to {tmp_path}/model: No space left on device"
    gate = Gate(CheckpointError(message))
    gate.released.set()
    run = saving_run(tmp_path, monkeypatch, gate)
    saves.save_in_background(run)  # returns: the failure is not known yet
    with pytest.raises(CheckpointError) as at_next_save:
        saves.save_in_background(run)
    assert str(at_next_save.value) == message and len(gate.calls) == 1  # the failed save's successor never started
    saves.save_in_background(run)
    with pytest.raises(CheckpointError, match="No space left on device"):
        saves.finish_saves(run)


def test_the_inference_copy_is_a_plain_model_on_the_host():
    from tests.helpers.tiny_model import tiny_model

    live = tiny_model()
    copy = host_model(live.config, to_host({k: v.to(torch.bfloat16) for k, v in live.state_dict().items()}), live)
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in copy.parameters())
    assert copy.lm_head.weight is copy.model.embed_tokens.weight or not live.config.tie_word_embeddings
    with torch.no_grad():
        live.model.embed_tokens.weight.add_(1)
    assert not torch.equal(copy.model.embed_tokens.weight.float(), live.model.embed_tokens.weight)


def test_a_save_makes_no_blocking_copy_to_the_host(tmp_path, monkeypatch):
    """A blocking copy from a GPU to the host waits for all the GPU's queued work: the save would
    stall the loop. Every copy the save's enqueue makes goes through `to_host` (asynchronous into
    pinned memory on a GPU), the RoPE tables of the inference copy too."""
    gate = Gate()
    gate.released.set()
    run = saving_run(tmp_path, monkeypatch, gate)
    blocking, original = [], torch.Tensor.to

    def recorded_to(tensor, *args, **kwargs):
        device = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
        if device is not None and torch.device(device).type == "cpu" and not kwargs.get("non_blocking"):
            blocking.append(tuple(tensor.shape))
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recorded_to)
    saves.save_in_background(run)
    monkeypatch.setattr(torch.Tensor, "to", original)
    saves.finish_saves(run)
    assert blocking == []
    model = run.writer.buffers["weights"]
    copy = host_model(run.raw_model.config, model, run.raw_model)
    for name in ("freqs_cos", "freqs_sin"):
        live = getattr(run.raw_model.model, name)
        assert torch.equal(getattr(copy.model, name), live) and getattr(copy.model, name).data_ptr() != live.data_ptr()


def test_the_next_save_refills_the_host_buffers_of_the_last_one(tmp_path, monkeypatch):
    gate = Gate()
    gate.released.set()
    run = saving_run(tmp_path, monkeypatch, gate)
    run.tokenizer = SimpleNamespace(vocab={"a": 0, "b": 1})
    batches = micro_batches()
    addresses = []
    for _ in range(2):
        step(run, batches, 1e-3)
        at_save = {key: value.clone() for key, value in run.raw_model.state_dict().items()}
        saves.save_in_background(run)
        saves.finish_saves(run)
        copy = run.writer.buffers
        addresses.append([copy["content"]["model"][key].data_ptr() for key in at_save]
                         + [copy["weights"][key].data_ptr() for key in at_save])
        saved = torch.load(checkpoint_path(str(tmp_path), run.state.step), weights_only=True)
        for key, value in at_save.items():
            assert torch.equal(saved["model"][key], value) and torch.equal(gate.calls[-1][key], value), key
    assert addresses[0] == addresses[1]  # the same memory, filled again
    assert gate.models[0] is gate.models[1]  # the inference copy around those buffers, built once
    # the writer's tokenizer: a copy of the run's (not shared with the training thread), made once
    assert gate.tokenizers[0] is gate.tokenizers[1] and gate.tokenizers[0] is not run.tokenizer
    assert gate.tokenizers[0].vocab == run.tokenizer.vocab
    assert to_host({"a": torch.ones(2)}, {"a": torch.zeros(3)})["a"].shape == (2,)  # a changed shape: new memory


def test_a_tied_embedding_is_copied_and_saved_once(tmp_path, monkeypatch):
    """A tied model's state dict names the embedding twice (`lm_head.weight`): one host copy and one
    tensor in the resume checkpoint, not two (Qwen3-0.6B: 622 MB more in every file and in the
    save's pinned host memory)."""
    gate = Gate()
    gate.released.set()
    run = saving_run(tmp_path, monkeypatch, gate)
    assert run.raw_model.config.tie_word_embeddings
    step(run, micro_batches(), 1e-3)
    saves.save_in_background(run)
    saves.finish_saves(run)
    for copy in (run.writer.buffers["weights"], run.writer.buffers["content"]["model"]):
        assert copy["lm_head.weight"] is copy["model.embed_tokens.weight"]
    saved = torch.load(checkpoint_path(str(tmp_path), 1), weights_only=True)["model"]
    head, embedding = saved["lm_head.weight"], saved["model.embed_tokens.weight"]
    assert head.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()
    assert torch.equal(embedding, run.raw_model.model.embed_tokens.weight)
    model = gate.models[-1]
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_only_views_of_the_same_elements_share_a_host_copy():
    base = torch.arange(12.0)
    tree = {"a": base.view(3, 4), "b": base.view(3, 4), "c": base.view(4, 3), "d": base[:6], "e": base.clone(),
            "f": torch.empty(0), "g": torch.empty(0)}
    copy = to_host(tree)
    assert copy["a"] is copy["b"]
    assert len({id(copy[key]) for key in "acdefg"}) == 6
    assert all(torch.equal(copy[key], tree[key]) for key in tree)
    with FakeTensorMode():  # no addresses: tensors of one shape are still told apart by their storage
        fake = [torch.empty(4, device="cuda") for _ in range(2)]
        assert same_memory_key(fake[0]) != same_memory_key(fake[1])
        assert same_memory_key(fake[0]) == same_memory_key(fake[0].view(4))


class MadeTensors(TorchDispatchMode):
    """The storages of the tensors every op makes in `dtype` (views left out)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.storages = dtype, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.storages += [t.untyped_storage().data_ptr() for t in tree_leaves(out)
                              if isinstance(t, torch.Tensor) and t.dtype == self.dtype]
        return out


def test_the_inference_weights_are_cast_one_at_a_time_as_they_are_copied(tmp_path, monkeypatch):
    """--save_dtype bfloat16: every weight is cast as it is copied into the save's host buffers, so
    the save makes no cast copy of all the weights beside them (on a GPU, device memory a save
    would need at once: tests/test_cuda.py measures it there)."""
    gate = Gate()
    gate.released.set()
    run = saving_run(tmp_path, monkeypatch, gate)
    run.args.save_dtype = "bfloat16"
    step(run, micro_batches(), 1e-3)
    made = MadeTensors(torch.bfloat16)
    with made:
        saves.save_in_background(run)
    saves.finish_saves(run)
    weights = run.writer.buffers["weights"]
    assert sorted(made.storages) == sorted({value.untyped_storage().data_ptr() for value in weights.values()})
    for key, value in run.raw_model.state_dict().items():
        assert weights[key].dtype == torch.bfloat16 and torch.equal(weights[key], value.to(torch.bfloat16)), key
        assert torch.equal(gate.calls[-1][key], weights[key]), key


@pytest.mark.slow
def test_every_rank_stops_with_the_one_line_error_of_a_failed_background_write(data, tmp_path):
    save_dir = tmp_path / "run"
    result = run_trainer(flags(data, save_dir, "--batch_size", "2", "--max_steps", "8", "--save_interval", "2"),
                         nproc=2, check=False, script=os.path.join(REPO, "tests", "helpers", "failing_save.py"),
                         env=clean_env(MINISFT_TEST_FAIL_SAVE_AT="2"))
    line = f"error: could not write inference weights to {save_dir}/model: No space left on device"
    # both ranks fail with it at the save of step 6; the line they share is printed once
    assert result.stderr.count(line) == 1, result.stderr[-3000:]
    assert "exitcode  : 2" in result.stderr and "saved" in result.stdout
    assert sorted(os.listdir(save_dir / "checkpoints")) == ["step_00000002.pt", "step_00000004.pt"]


def test_the_gathered_inference_copy_holds_a_tied_embedding_once():
    """--fsdp 1's save of the inference weights (trainer/parallel/fsdp.py `gather_to_rank0`, here on a plain
    model, which needs no collective): a tied `lm_head.weight` is the embedding, not all-gathered and copied
    to rank 0's host a second time (Qwen3-0.6B: 622 MB more gathered, 311 MB more host memory in bfloat16)."""
    from tests.helpers.tiny_model import tiny_model
    from trainer.parallel.fsdp import gather_to_rank0

    live = tiny_model()
    made = MadeTensors(torch.bfloat16)
    with made:
        copy = gather_to_rank0(live, True, torch.bfloat16)
    assert copy.lm_head.weight is copy.model.embed_tokens.weight
    weights = {p.untyped_storage().data_ptr() for p in copy.parameters()}
    assert sorted(made.storages) == sorted(weights)
    for key, value in live.state_dict().items():
        assert torch.equal(copy.state_dict()[key], value.to(torch.bfloat16)), key
