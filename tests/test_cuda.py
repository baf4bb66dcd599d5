"""The CUDA paths (cuda autocast, the fp16 GradScaler, NCCL, saves, generation). The suite hides
the GPUs from every other test (tests/conftest.py); these run on their own, in one process, with
the GPUs shown:

    python -m pytest tests/test_cuda.py --gpus -n 0

Without --gpus, or on a machine without a GPU (CI), they are skipped. The tests are written in
tests/cuda/, a module per concern, and run here: pytest collects the test functions of this
module's namespace, where each module's are put, so each is tests/test_cuda.py::test_..."""

import pytest
import torch

from tests.cuda import generation, host_syncs, kernels, runs, saves

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU, shown to the tests: python -m pytest tests/test_cuda.py --gpus -n 0"),
]

MODULES = (generation, host_syncs, kernels, runs, saves)
TESTS = {name: test for module in MODULES for name, test in vars(module).items() if name.startswith("test_")}
assert len(TESTS) == sum(name.startswith("test_") for module in MODULES for name in vars(module)), "a name twice"
globals().update(TESTS)
