"""scripts/_bench_common.py: the device timer (CUDA events on a GPU), the precision policy, the batches timed,
the JSON report, the shared flags' --help."""

import argparse
import json

import pytest
import torch

from scripts._bench_common import (
    DeviceTimer, add_model_flags, add_run_flags, endless_batches, follow_precision_policy, ready_batches, write_report,
)
from scripts._common import ArgumentParser


class FakeEvent:
    """torch.cuda.Event's timing surface, recording what the timer does with it."""

    log = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.name = f"event{len([entry for entry in self.log if entry[0] == 'new'])}"
        self.log.append(("new", self.name))

    def record(self, stream=None):
        self.log.append(("record", self.name))

    def synchronize(self):
        self.log.append(("synchronize", self.name))

    def elapsed_time(self, end):
        self.log.append(("elapsed_time", self.name, end.name))
        return 1250.0  # milliseconds


def test_on_cuda_the_timer_reads_two_cuda_events_not_the_host_clock(monkeypatch):
    FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr("time.perf_counter", lambda: pytest.fail("host clock read on CUDA"))
    timer = DeviceTimer(torch.device("cuda", 0))
    timer.start()
    assert timer.stop() == 1.25
    assert FakeEvent.log == [("new", "event0"), ("record", "event0"), ("new", "event1"), ("record", "event1"),
                             ("synchronize", "event1"), ("elapsed_time", "event0", "event1")]


def test_on_cpu_the_timer_reads_the_host_clock(monkeypatch):
    clock = iter([10.0, 12.5])
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    monkeypatch.setattr(torch.cuda, "Event", lambda **kwargs: pytest.fail("CUDA event on CPU"))
    timer = DeviceTimer(torch.device("cpu"))
    timer.start()
    assert timer.stop() == 2.5


def test_float32_runs_without_tf32_and_autocast_runs_may_use_it():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        follow_precision_policy(torch.device("cuda", 0), torch.float32)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
        follow_precision_policy(torch.device("cuda", 0), torch.bfloat16)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
        torch.backends.cuda.matmul.allow_tf32 = False
        follow_precision_policy(torch.device("cpu"), torch.bfloat16)  # a CPU run leaves the GPU settings alone
        assert torch.backends.cuda.matmul.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class LoggedLoader:
    """A loader of three batches per epoch that logs when an epoch's iteration starts and each batch it hands out."""

    def __init__(self, log):
        self.log, self.sampler, self.epoch = log, self, None

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        self.log.append(("start", self.epoch))
        for index in range(3):
            self.log.append(("batch", self.epoch, index))
            yield {"epoch": self.epoch, "index": index}


def logged_data(log):
    loader = LoggedLoader(log)
    return type("Data", (), {"sampler": loader, "loader": loader})()


def test_timed_batches_have_the_loader_started_before_the_first_is_asked_for():
    """The benchmark times steps from ready_batches: the loader's start (its worker processes on a
    GPU machine) and its first batch happen when the iterator is made, not inside a timed step;
    the batches are endless_batches' own, epoch after epoch."""
    log = []
    batches = ready_batches(logged_data(log))
    assert log == [("start", 0), ("batch", 0, 0)]
    taken = [next(batches) for _ in range(7)]
    plain = endless_batches(logged_data([]))
    assert taken == [next(plain) for _ in range(7)] == [
        {"epoch": epoch, "index": index} for epoch in range(3) for index in range(3)][:7]


def test_the_report_goes_into_json_out_whose_missing_folders_are_made(tmp_path):
    """check_output_file lets a --json_out in folders that do not exist yet through at the start, so
    the report, written after the whole run, makes them rather than failing there."""
    target = tmp_path / "runs" / "cpu" / "bench.json"
    write_report(argparse.Namespace(json_out=str(target)), {"summary": "summary: best dynamic", "rows": [1, 2]})
    assert json.loads(target.read_text(encoding="utf-8")) == {"summary": "summary: best dynamic", "rows": [1, 2]}


def test_help_gives_the_model_shape_and_seed_with_their_defaults():
    """bench.py, bench_scaling.py and profile_step.py --help: a flag without a help shows no default."""
    parser = ArgumentParser(prog="bench.py")
    add_model_flags(parser)
    add_run_flags(parser)
    words = " ".join(parser.format_help().split())
    for shown in ("--hidden_size HIDDEN_SIZE the model's width (default: 256)",
                  "--num_hidden_layers NUM_HIDDEN_LAYERS blocks (default: 4)",
                  "--max_seq_len MAX_SEQ_LEN rows are cut to this many tokens, as in training (default: 512)",
                  "--seed SEED the trainer's --seed (default: 42)"):
        assert shown in words
