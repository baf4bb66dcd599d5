"""`python forked_launch.py NPROC PORT SCRIPT ARGS...`: a single-node launch of SCRIPT on NPROC
ranks by torch's elastic agent, as `torchrun --nproc_per_node NPROC --master_port PORT SCRIPT ARGS`
does, with each worker forked from this process instead of started anew.

This process imports the trainer (torch, transformers) once, before the agent starts; each worker
runs SCRIPT as `__main__` with its own `sys.argv` and the environment the agent gives it (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_*, TORCHELASTIC_*), and ends with SCRIPT's exit code. What a
worker does not pay is its own import, about 6 CPU-seconds on the test machines. The tests of the
training (equality across world sizes, resume, evaluation) launch through it; the tests of what
torchrun itself does (its exit codes, signals to its agent, restarts, several nodes) launch torchrun.
A worker that fails makes this process exit 1, as torchrun does.
"""

import importlib
import os
import runpy
import sys
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: E402

from tests.helpers.warm_start import exit_code  # noqa: E402


def worker(script: str, args: list[str]) -> None:
    """SCRIPT as `__main__` in this forked worker; a non-zero exit code ends the process with it."""
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = exit_code(stop)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)


def main() -> int:
    importlib.import_module("train_full_sft")  # once, here, for every worker
    nproc, port, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"rank": 0},
                          max_restarts=0, monitor_interval=0.1, start_method="fork")
    try:
        elastic_launch(config, worker)(script, args)
    except ChildFailedError as failure:
        print(f"forked_launch: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
