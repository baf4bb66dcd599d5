"""Fixtures of the end-to-end tests: a process launcher, and uninterrupted runs that faulted runs must equal."""

import pytest

from tests.helpers.fault_checks import ONE_PROCESS, TWO_PROCESSES
from tests.helpers.trainer_launch import Launcher, flags, run_trainer, run_trainer_in_process


@pytest.fixture
def launcher(tmp_path):
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("reference_one")
    run_trainer_in_process(flags(data, save_dir, *ONE_PROCESS), check=True)  # what is checked is its weights
    return save_dir


@pytest.fixture(scope="module")
def reference_two(data, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("reference_two")
    run_trainer(flags(data, save_dir, *TWO_PROCESSES), nproc=2)
    return save_dir
