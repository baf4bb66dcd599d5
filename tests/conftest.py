"""Fixtures shared by the test folders: the GPU option, demo conversations, and an overfitted tiny model."""

import os

import pytest
import torch

from tests.helpers.overfitted import overfitted_model
from tests.helpers.trainer_launch import GPUS_OPTION, REPO, hide_gpus
from trainer.data_setup import usable_cpus


def pytest_addoption(parser):
    parser.addoption(GPUS_OPTION, action="store_true",
                     help="let the tests see this machine's GPUs (for tests/test_cuda.py; every other test runs on CPU)")


def pytest_configure(config):
    """Before any test module is imported: GPUs hidden unless GPUS_OPTION is given; an xdist
    worker takes its share of the cores."""
    if not config.getoption(GPUS_OPTION):
        hide_gpus(os.environ)
    share_cores(os.environ)


def share_cores(environ) -> None:
    """In an xdist worker (unless OMP_NUM_THREADS is set): torch threads for the tests it runs in
    its own process, and OMP_NUM_THREADS for the processes it starts, are the cores over the
    workers, so N workers do not each run a thread per core (a trainer run sets its own 1)."""
    workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not workers or "OMP_NUM_THREADS" in environ:
        return
    threads = max(1, usable_cpus() // workers)
    environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """96 demo conversations (varied lengths, so batches carry unequal loss-token counts), among
    them tool-calling conversations and reasoning traces (checked here)."""
    folder = tmp_path_factory.mktemp("data")
    lines = open(os.path.join(REPO, "dataset", "demo", "sft_train.jsonl"), encoding="utf-8").readlines()
    assert sum('"tool_calls"' in line for line in lines[:96]) >= 5 and sum("reasoning_content" in line for line in lines[:96]) >= 5
    (folder / "train.jsonl").write_text("".join(lines[:96]), encoding="utf-8")
    (folder / "eval.jsonl").write_text("".join(lines[-16:]), encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """tests/helpers/overfitted.py's model, built once for the tests of the scripts and of loading a model path."""
    return overfitted_model(tmp_path_factory)
