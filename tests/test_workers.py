"""tests/conftest.py: each xdist worker runs on its share of the cores."""

import os

import pytest
import torch

from tests.conftest import share_cores
from trainer.data_setup import usable_cpus


def test_a_worker_gets_the_cores_over_the_workers_and_its_processes_inherit_it(monkeypatch):
    cores = usable_cpus()
    threads = torch.get_num_threads()
    try:
        for workers, expected in ((1, cores), (cores, 1), (4 * cores, 1)):
            environ = {"PYTEST_XDIST_WORKER_COUNT": str(workers)}
            share_cores(environ)
            assert (environ["OMP_NUM_THREADS"], torch.get_num_threads()) == (str(expected), expected)
        torch.set_num_threads(threads)
        for environ in ({}, {"PYTEST_XDIST_WORKER_COUNT": "2", "OMP_NUM_THREADS": "3"}):  # not a worker; set by the user
            before = dict(environ)
            share_cores(environ)
            assert environ == before and torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif("PYTEST_XDIST_WORKER_COUNT" not in os.environ, reason="runs in an xdist worker")
def test_this_worker_runs_on_its_share():
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
