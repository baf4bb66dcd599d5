"""Step 9's teardown (`trainer.runtime.distributed.cleanup`): once the process groups are destroyed,
nothing holds one any more, so no gloo worker thread runs into the interpreter's exit, where tearing
it down can abort a finished run. What held them: the groups opened beside the default one (kept by
this package) and, after FSDP2, torch's DTensor caches (their entries hold the device mesh, the mesh
its group, so the trainer drops the groups of any mesh still alive)."""

import json
import os

import pytest

from tests.helpers import warm_start
from tests.helpers.trainer_launch import REPO, clean_env, flags, run_trainer, torchrun_cmd

HELPERS = os.path.join(REPO, "tests", "helpers")


def gloo_threads(names: list[str]) -> list[str]:
    return [name for name in names if "gloo" in name]


def test_cleanup_leaves_no_gloo_thread_running(tmp_path):
    report = tmp_path / "threads.json"
    result = warm_start.run(os.path.join(HELPERS, "teardown_check.py"), [str(tmp_path / "store"), str(report)], REPO,
                            clean_env(), clean_env(), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    threads = json.loads(report.read_text())
    # Three groups (default, host values, checkpoints), each with two worker threads.
    assert threads["before"].count("pt_gloo_runloop") == 6
    assert gloo_threads(threads["after"]) == []


@pytest.mark.slow
def test_a_finished_fsdp_run_exits_with_no_gloo_thread_running(data, tmp_path):
    """Two FSDP2 processes under torchrun, a sharded checkpoint written on the checkpoints' group: at
    each rank's exit, after every atexit handler, no gloo thread is left. (Launched by torchrun
    itself: the forked launcher's workers end without the interpreter's exit.)"""
    report = tmp_path / "threads"
    run_trainer([str(report), os.path.join(REPO, "train_full_sft.py"),
                 *flags(data, tmp_path / "run", "--batch_size", "3", "--max_steps", "2", "--save_interval", "1",
                        "--fsdp", "1")],
                script=os.path.join(HELPERS, "threads_at_exit.py"), launcher=torchrun_cmd(2))
    for rank in (0, 1):
        names = json.loads((tmp_path / f"threads.{rank}.json").read_text())
        assert names and gloo_threads(names) == [], (rank, names)
