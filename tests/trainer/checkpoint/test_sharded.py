"""Sharded resume checkpoints in one process (trainer/checkpoint/sharded.py): a shard cut short or
missing, and an index or an entry that would run code (trainer/checkpoint/dcp_reading.py), are found when
the checkpoint is chosen, the load gives back every value saved and says nothing of torch.distributed, a
save on a GPU machine makes no CUDA call in DCP's writer thread, and the state a save takes
(trainer/parallel/fsdp.py) leaves an optimizer that has not stepped as it is."""

import os
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict

from tests.helpers.malicious_pickle import RunsCode, malicious_dcp_index
from tests.helpers.tiny_model import tiny_model
from trainer.checkpoint.files import atomic_torch_save
from trainer.checkpoint.resume import find_resume_checkpoint, load_resume_checkpoint
from trainer.checkpoint.sharded import META, load_training_state, read_full, sharded_path, start_save
from trainer.checkpoint.single_file import stamped
from trainer.parallel.fsdp import FullyShardedParallel
from trainer.errors import CheckpointError

SHARD = "__0_0.distcp"  # what one process writes


def trained(seed: int):
    """A tiny model and its AdamW after one step (so the optimizer has state to save)."""
    model = tiny_model(seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.randint(0, 97, (2, 8)), labels=torch.randint(0, 97, (2, 8))).loss.backward()
    optimizer.step()
    return model, optimizer


def adamw(model):
    """The trainer's optimizer (trainer/model_setup.py: build_optimizer) for `model`."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), fused=True)


def write_sharded(save_dir, step: int, model, optimizer, change=None) -> str:
    """A sharded checkpoint as one process writes it: the shard and DCP's index, then meta.pt.
    `change(optimizer_state)` alters what is saved of the optimizer."""
    path = sharded_path(str(save_dir), step)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    if change is not None:
        change(optimizer_state)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path, no_dist=True)
    meta = {"model_config": model.config.to_dict(), "step": step, "epoch": 0, "samples_in_epoch": 0, "rng": [],
            "world_size": 1, "args": {}}
    atomic_torch_save(stamped(meta), os.path.join(path, META))
    return path


def test_a_truncated_or_missing_shard_is_skipped_for_the_checkpoint_before(tmp_path):
    model, optimizer = trained(0)
    paths = [write_sharded(tmp_path, step, model, optimizer) for step in (1, 2, 3)]
    size = os.path.getsize(os.path.join(paths[2], SHARD))
    os.truncate(os.path.join(paths[2], SHARD), 1000)
    os.remove(os.path.join(paths[1], SHARD))
    messages = []
    found, saved = find_resume_checkpoint(str(tmp_path), log=messages.append)
    assert (found, saved["step"]) == (paths[0], 1)
    assert messages == [
        f"warning: skipping unusable checkpoint: sharded checkpoint {paths[2]} is truncated ({SHARD} holds 1000 "
        f"bytes, its index needs {size}); falling back to the previous one",
        f"warning: skipping unusable checkpoint: sharded checkpoint {paths[1]} is incomplete (no {SHARD}); falling "
        "back to the previous one"]


def test_a_sharded_checkpoint_loads_in_one_process_without_a_warning(tmp_path):
    """Every tensor bit for bit, and the optimizer's non-tensor values (DCP's byte entries: lr, betas, ...)."""
    model, optimizer = trained(0)
    path = write_sharded(tmp_path, 1, model, optimizer)
    other, other_optimizer = trained(1)
    other_optimizer.param_groups[0].update(lr=0.5, betas=(0.8, 0.9), amsgrad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_training_state(other, other_optimizer, load_resume_checkpoint(path))
    assert [str(warning.message) for warning in caught] == []
    assert all(torch.equal(value, other.state_dict()[key]) for key, value in model.state_dict().items())
    saved, loaded = optimizer.state_dict(), other_optimizer.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    assert all(torch.equal(value, loaded["state"][index][name])
               for index, state in saved["state"].items() for name, value in state.items())


class CudaCalls:
    """torch.cuda as on a GPU machine, for the length of a test: every call that would reach the
    driver (a stream, a synchronize, the current device) recorded with the thread that made it."""

    NAMES = ("current_stream", "default_stream", "stream", "synchronize", "current_device", "set_device", "Stream",
             "Event")

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        for name in self.NAMES:
            monkeypatch.setattr(torch.cuda, name, self.recorded(name))

    def recorded(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, threading.current_thread().name))
            return FakeStream(self)
        return call


class FakeStream:
    """What the recorded calls return: a CUDA stream (also its context manager) that records its own calls."""

    device_type = "cuda"

    def __init__(self, cuda: CudaCalls):
        self.cuda = cuda

    def __eq__(self, other):
        return isinstance(other, FakeStream)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        self.cuda.calls.append(("stream.synchronize", threading.current_thread().name))

    def wait_stream(self, other):
        self.cuda.calls.append(("stream.wait_stream", threading.current_thread().name))


def test_a_sharded_save_on_a_gpu_machine_makes_no_cuda_call_in_any_thread(tmp_path, monkeypatch):
    """DCP's worker thread has GPU 0 as its current device whatever the rank's: a CUDA call there would
    give every other local rank a context on GPU 0. The shards are staged to host memory before it
    starts, so the write makes none (and the state is in host memory already here: none anywhere)."""
    model = tiny_model(0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        cuda = CudaCalls(monkeypatch)
        content = {"step": 3, "model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}}
        save = start_save(content, str(tmp_path / "run"), 2, SimpleNamespace(is_main=True, device=torch.device("cpu")))
        path = save.wait()
        calls = cuda.calls
        monkeypatch.undo()
    finally:
        dist.destroy_process_group()
    assert calls == []
    assert path == sharded_path(str(tmp_path / "run"), 3)
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in read_full(path, "model").items())


def test_the_state_of_a_save_before_the_first_step_leaves_the_optimizer_unstepped():
    """torch's get_state_dict makes the state of an optimizer without one by a step at learning rate 0
    (AdamW's counter at 1). The save takes that state off the optimizer again and gives its counters
    as 0, so the next step, live or after a resume, is the first one, bit for bit."""
    model = tiny_model(0).train()
    optimizer = adamw(model)
    parallel = FullyShardedParallel(SimpleNamespace(), torch.float32)
    parallel.model = model
    saved = parallel.training_state(optimizer)
    assert not optimizer.state
    steps = [state["step"] for state in saved["optimizer"]["state"].values()]
    assert len(steps) == len(list(model.parameters())) and all(step.item() == 0 for step in steps)
    fresh = tiny_model(0).train()
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(1))
    for each, its_optimizer in ((model, optimizer), (fresh, adamw(fresh))):
        each(input_ids=ids, labels=ids).loss.backward()
        its_optimizer.step()
    assert all(torch.equal(value, fresh.state_dict()[key]) for key, value in model.state_dict().items())


def test_the_safe_reader_reads_dcps_index_as_dcp_does(tmp_path):
    from trainer.checkpoint.dcp_reading import SafeReader

    model, optimizer = trained(0)
    path = write_sharded(tmp_path, 1, model, optimizer)
    ours, dcps = SafeReader(path).read_metadata(), FileSystemReader(path).read_metadata()  # the test's own file
    assert (ours.state_dict_metadata, ours.storage_data, ours.planner_data, ours.version) == \
        (dcps.state_dict_metadata, dcps.storage_data, dcps.planner_data, dcps.version)
    assert ours.storage_meta.checkpoint_id == dcps.storage_meta.checkpoint_id


def test_an_index_that_would_run_code_is_refused_and_skipped(tmp_path):
    """A crafted `.metadata`: --from_resume's scan falls back past it, --resume_from and a model path
    refuse it in one line, and its code never runs."""
    model, optimizer = trained(0)
    paths = [write_sharded(tmp_path, step, model, optimizer) for step in (1, 2)]
    marker = tmp_path / "code_ran"
    malicious_dcp_index(paths[1], marker)
    refusal = (f"refused to load {os.path.join(paths[1], '.metadata')}: it contains Python objects (posix.system) "
               "that a safe load of DCP's index does not allow; it is not a minisft checkpoint and may be malicious")
    messages = []
    found, saved = find_resume_checkpoint(str(tmp_path), log=messages.append)
    assert (found, saved["step"]) == (paths[0], 1)
    assert messages == [f"warning: skipping unusable checkpoint: {refusal}; falling back to the previous one"]
    for required in (("model_config", "model"), ()):
        with pytest.raises(CheckpointError) as refused:
            load_resume_checkpoint(paths[1], required=required)
        assert str(refused.value) == refusal
    assert not marker.exists()


def test_an_entry_that_would_run_code_is_refused_and_skipped(tmp_path):
    """A non-tensor entry of the shards (the optimizer's lr) that runs a shell command when unpickled: found
    when the checkpoint is chosen, and refused by the load itself where the choice is skipped."""
    model, optimizer = trained(0)
    marker = tmp_path / "code_ran"

    def planted(optimizer_state):
        optimizer_state["param_groups"][0]["lr"] = RunsCode(marker)

    good = write_sharded(tmp_path, 1, model, optimizer)
    bad = write_sharded(tmp_path, 2, model, optimizer, change=planted)
    refusal = (f"refused to load {os.path.join(bad, SHARD)}: its entry optimizer.param_groups.0.lr holds Python "
               "objects that a safe (weights_only) load does not allow; it is not a minisft checkpoint and may be "
               "malicious")
    messages = []
    found, saved = find_resume_checkpoint(str(tmp_path), log=messages.append)
    assert (found, saved["step"]) == (good, 1)
    assert messages == [f"warning: skipping unusable checkpoint: {refusal}; falling back to the previous one"]
    other, other_optimizer = trained(1)
    with pytest.raises(CheckpointError) as refused:
        load_training_state(other, other_optimizer, {"sharded_path": bad})
    assert str(refused.value) == refusal
    assert not marker.exists()
