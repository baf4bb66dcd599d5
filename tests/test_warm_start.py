"""tests/helpers/warm_start.py: a run forked from the warm server ends as the same command run as a
fresh process ends (exit code, stdout, stderr, what it sees), so the tests that run the trainer
through it check what a user's `python train_full_sft.py` does."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import warm_start
from tests.helpers.trainer_launch import clean_env

SCRIPT = """
import atexit, os, sys, threading, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "X", os.environ.get("X"), "stdin", repr(sys.stdin.read()))
print("path0", sys.path[0], "helpers on path", any(p.endswith(os.path.join("tests", "helpers")) for p in sys.path))
print("to stderr", file=sys.stderr)
atexit.register(print, "atexit handler")
threading.Thread(target=lambda: (time.sleep(0.2), print("non-daemon thread"))).start()
how = sys.argv[1]
if how == "raise":
    raise ValueError("boom")
sys.exit({"code": 3, "none": None, "text": "a message"}[how])
"""


def fresh(script, args, cwd, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("how", ["code", "none", "text", "raise"])
def test_a_warm_run_ends_as_the_same_fresh_process_ends(tmp_path, how):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = clean_env(X="y")
    warm = warm_start.run(str(script), [how], str(tmp_path), env, clean_env(), timeout=60)
    plain = fresh(script, [how], tmp_path, env)
    assert (warm.returncode, warm.stdout) == (plain.returncode, plain.stdout)
    assert plain.stdout.splitlines()[1:] == [f"path0 {tmp_path} helpers on path False", "non-daemon thread",
                                             "atexit handler"]
    if how == "raise":  # the traceback's frames differ (runpy's); its first and last lines do not
        assert warm.stderr.startswith("to stderr\nTraceback") and warm.stderr.endswith("ValueError: boom\n")
    else:
        assert warm.stderr == plain.stderr


def test_a_killed_or_timed_out_warm_run_reads_as_popen_reports_it(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import pathlib, time\nprint('started', flush=True)\npathlib.Path('started').touch()\n"
                      "time.sleep(60)\n")
    process = warm_start.start(str(script), [], str(tmp_path), clean_env(), clean_env())
    while not (tmp_path / "started").exists():
        assert process.poll() is None
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    assert process.communicate(timeout=30) == ("started\n", "") and process.returncode == -signal.SIGKILL
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm_start.run(str(script), [], str(tmp_path), clean_env(), clean_env(), timeout=1)
    assert time.monotonic() - began < 30


def test_a_run_whose_import_time_environment_differs_or_that_may_see_a_gpu_starts_fresh(tmp_path):
    script = tmp_path / "threads.py"
    script.write_text("import torch\nprint(torch.get_num_threads())\n")
    warm = warm_start.start(str(script), [], str(tmp_path), clean_env(), clean_env())
    other = warm_start.start(str(script), [], str(tmp_path), dict(clean_env(), OMP_NUM_THREADS="2"), clean_env())
    assert type(warm) is warm_start.WarmProcess and type(other) is subprocess.Popen
    assert (warm.communicate(timeout=60)[0], other.communicate(timeout=60)[0]) == ("1\n", "2\n")
    shown = {key: value for key, value in clean_env().items() if key != "CUDA_VISIBLE_DEVICES"}  # as under --gpus
    assert not warm_start.can_warm_start(shown, shown) and warm_start.can_warm_start(clean_env(), clean_env())
