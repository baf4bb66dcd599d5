"""Processes, devices, signals, flags and error handling."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.trainer_launch import (
    GPUS_OPTION, REPO, checkpoint_at, clean_env, final_weights, flags, hide_gpus, metric_rows, run_trainer,
    run_trainer_in_process, torchrun_cmd, train_losses, wait_until,
)
from trainer.args import parse_args
from trainer.errors import DistributedError
from trainer.runtime.distributed import is_peer_failure, pick_device
from trainer.runtime.precision import cpu_has_native_bf16, INITIAL_LOSS_SCALE, resolve_dtype, scaler_state_for_resume
from trainer.errors import LoggingError
from trainer.run_logger import check_wandb_login

STEPS = ["--batch_size", "4", "--max_steps", "10", "--save_interval", "5", "--keep_last", "10"]


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# --------------------------------------------------------------------------- device choice


def test_the_suite_hides_the_gpus_from_every_process_it_starts(request):
    """tests/conftest.py hides the GPUs unless --gpus is given: this process and every process it
    starts (the launch helpers' env, and a plain inherited one as scripts tests use) see none, so
    each test runs on CPU and gloo on any machine."""
    if request.config.getoption(GPUS_OPTION):
        pytest.skip("--gpus shows the GPUs to the tests")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    probe = "import os, torch; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), torch.cuda.device_count())"
    for env in (clean_env(), None):
        shown = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert shown.stdout.split() == ["''", "0"]
    environ = {"CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin"}
    hide_gpus(environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": "", "PATH": "/bin"}



def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_device_follows_what_the_process_can_see(monkeypatch):
    args = parse_args([])
    fake_gpus(monkeypatch, 1)  # srun --gpus-per-task 1: every task sees exactly its own GPU
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_GPUS_PER_TASK": "1"}
    assert [pick_device(args, rank, slurm) for rank in range(4)] == [torch.device("cuda", 0)] * 4
    fake_gpus(monkeypatch, 4)  # torchrun on a node with 4 visible GPUs
    assert [pick_device(args, rank, {"LOCAL_WORLD_SIZE": "4"}) for rank in range(4)] == [torch.device("cuda", r) for r in range(4)]
    fake_gpus(monkeypatch, 2)
    with pytest.raises(DistributedError, match=r"3 processes on this node but this process sees 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES=2,3\)"):
        pick_device(args, 2, {"CUDA_VISIBLE_DEVICES": "2,3"})
    fake_gpus(monkeypatch, 0)
    assert pick_device(args, 3) == torch.device("cpu")


# --------------------------------------------------------------------------- flags


@pytest.mark.parametrize("argv, message", [
    (["--learning_rate", "inf"], "--learning_rate must be a finite number (got inf)"),
    (["--learning_rate", "nan"], "--learning_rate must be a finite number (got nan)"),
    (["--grad_clip=-inf"], "--grad_clip must be a finite number (got -inf)"),
    (["--warmup_steps", "-5"], "--warmup_steps must be >= 0 (got -5)"),
    (["--min_lr_ratio", "1.5"], "--min_lr_ratio must be <= 1 (got 1.5)"),
    (["--dropout", "-0.1"], "--dropout must be >= 0 (got -0.1)"),
    (["--weight_decay", "-1"], "--weight_decay must be >= 0 (got -1.0)"),
    (["--learning_rate", "0"], "--learning_rate must be > 0 (got 0.0)"),
    (["--num_workers", "-1"], "--num_workers must be >= 0 (got -1)"),
    (["--device", "gpu"], "--device gpu: unknown device; for an NVIDIA GPU use cuda or cuda:N"),
    (["--device", "mps"], "--device mps: not supported (use auto, cpu, cuda or cuda:N)"),
    (["--device", "tpu:0"], "--device tpu:0: not supported (use auto, cpu, cuda or cuda:N)"),
])
def test_out_of_range_flags_are_refused_at_start(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert last_line(capsys.readouterr().err).endswith(f"error: {message}")


def test_every_numeric_flag_has_a_range():
    from trainer.args import build_parser

    # Flags with `choices` (0/1 switches) are checked by argparse itself.
    numeric = [action for action in build_parser()._actions if action.type in (int, float) and not action.choices]
    assert {action.dest for action in numeric if getattr(action, "bounds", None) is None} == set()


def test_a_learning_rate_that_breaks_the_weights_stops_before_any_nan_is_saved(data, tmp_path):
    # Finite flags, but an update that overflows the weights: the run stops at once (exit 1)
    # and every file it wrote holds finite weights.
    result = run_trainer_in_process(flags(data, tmp_path, "--batch_size", "4", "--max_steps", "4", "--save_interval",
                                          "1", "--learning_rate", "1e20", "--weight_decay", "1e20", "--warmup_steps",
                                          "0"))
    assert result.returncode == 1, result.stderr
    assert last_line(result.stderr).startswith("error: step 1 made the weights non-finite (--learning_rate 1e+20 or --weight_decay 1e+20 too large?)")
    assert "Traceback" not in result.stderr
    assert not os.path.exists(checkpoint_at(tmp_path, 1)) and not os.path.exists(tmp_path / "model")


# --------------------------------------------------------------------------- fp16 loss scale


def test_a_collapsed_fp16_loss_scale_is_reset_on_resume():
    # A CPU GradScaler driven by injected infs, as in a run stopped by --max_bad_steps.
    scaler = torch.amp.GradScaler("cpu", init_scale=INITIAL_LOSS_SCALE)
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for _ in range(21):
        scaler.scale((weight * float("inf")).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    collapsed = scaler.state_dict()
    assert collapsed["scale"] == INITIAL_LOSS_SCALE / 2**21
    said = []
    resumed = torch.amp.GradScaler("cpu")
    resumed.load_state_dict(scaler_state_for_resume(collapsed, said.append))
    assert resumed.get_scale() == INITIAL_LOSS_SCALE
    assert said == ["resume: the checkpoint's fp16 loss scale 0.0312 had collapsed; starting again from 65536"]
    healthy = {**collapsed, "scale": 1024.0}
    assert scaler_state_for_resume(healthy, said.append) == healthy and len(said) == 1


# --------------------------------------------------------------------------- bf16 on CPU


def test_bfloat16_on_a_cpu_without_native_bf16_warns(tmp_path, monkeypatch):
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n")
    bf16 = tmp_path / "bf16"
    bf16.write_text("processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16\n")
    assert not cpu_has_native_bf16(str(avx2))
    assert cpu_has_native_bf16(str(bf16))
    assert cpu_has_native_bf16(str(tmp_path / "absent"))  # unknown: no warning
    said = []
    monkeypatch.setattr("trainer.runtime.precision.cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("bfloat16", torch.device("cpu"), said.append) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu"), said.append) == torch.float32
    assert len(said) == 1 and said[0].startswith("warning: --dtype bfloat16 on a CPU without native bf16")


# --------------------------------------------------------------------------- errors: user's or ours


def test_peer_failures_are_recognised_without_swallowing_bugs(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert is_peer_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:5: "
                                            "Connection reset by peer"))
        assert is_peer_failure(RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                                            "10000ms for recv operation to complete"))
        # Bugs that merely mention the backend keep their traceback.
        assert not is_peer_failure(RuntimeError("Tensors must be CPU and dense (ProcessGroupGloo)"))
        assert not is_peer_failure(RuntimeError("NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details)"))
        assert not is_peer_failure(ValueError("Connection reset by peer"))
    finally:
        dist.destroy_process_group()
    assert not is_peer_failure(RuntimeError("Connection reset by peer"))  # no process group: not a peer


def test_an_oserror_from_a_bug_keeps_its_traceback_and_a_named_file_gets_one_line(data, tmp_path):
    # metrics.jsonl that cannot be written: the user's to fix, one line, exit 2 (main() in this process, as for
    # the next case: how main() ends is checked; the traceback and exit 1 of a bug need the real process).
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)
    result = run_trainer_in_process(flags(data, tmp_path / "run", "--batch_size", "4", "--max_steps", "1"))
    assert result.returncode == 2
    assert last_line(result.stderr) == f"error: could not write {tmp_path / 'run' / 'metrics.jsonl'}: Is a directory"
    assert "Traceback" not in result.stderr
    # A --cache_dir that is a file: named with its flag, one line, exit 2, before any data is read.
    (tmp_path / "cache").write_text("not a folder")
    result = run_trainer_in_process(flags(data, tmp_path / "cached", "--max_steps", "1", "--cache_dir",
                                          str(tmp_path / "cache")))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    cache = tmp_path / "cache"
    assert last_line(result.stderr) == f"error: --cache_dir {cache} cannot be a folder: {cache} is a file"
    # An OSError raised by our own code (here: a tokenizer call breaking mid-run) is a bug: traceback, exit 1.
    script = ("import sys, train_full_sft, dataset\n"
              "def broken(*a, **k): raise OSError(5, 'Input/output error')\n"
              "train_full_sft.build_train_data = broken\n"
              "sys.exit(train_full_sft.main(sys.argv[1:]))\n")
    result = subprocess.run([sys.executable, "-c", script, *flags(data, tmp_path / "bug", "--max_steps", "1")],
                            cwd=REPO, env=clean_env(PYTHONPATH=REPO), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and last_line(result.stderr) == "OSError: [Errno 5] Input/output error"


def test_wandb_without_a_login_is_one_line_before_anything_starts(data, tmp_path, monkeypatch):
    # main() in this process (what is checked is how main() ends, not the process), its environment
    # without wandb settings and with a HOME that has no ~/.netrc.
    for name in [name for name in os.environ if name.startswith("WANDB_")] + ["NETRC"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    result = run_trainer_in_process(flags(data, tmp_path / "run", "--max_steps", "1", "--use_wandb", "1"))
    assert result.returncode == 2
    assert last_line(result.stderr) == ("error: --use_wandb 1: not logged in to wandb (api.wandb.ai): "
                                        "run `wandb login` or set WANDB_MODE=offline")
    assert "Traceback" not in result.stderr
    assert not os.path.exists(tmp_path / "run" / "wandb")
    # Offline, or with a key in ~/.netrc, there is nothing to refuse.
    args = parse_args(["--use_wandb", "1"])
    with pytest.raises(LoggingError):
        check_wandb_login(args)
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_wandb_login(args)
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "home").mkdir(exist_ok=True)
    (tmp_path / "home" / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    check_wandb_login(args)


# --------------------------------------------------------------------------- signals


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["init", "shutdown"])
def test_sigterm_outside_the_loop_exits_zero(data, tmp_path, moment):
    # A real SIGTERM the process sends itself before init_distributed (long before the loop)
    # or after the final save (before the clean shutdown): nothing is lost, exit 0.
    result = run_trainer(flags(data, tmp_path, "--batch_size", "4", "--max_steps", "1"),
                         script=os.path.join(REPO, "tests", "helpers", "signal_self.py"),
                         env=clean_env(MINISFT_TEST_SIGTERM_AT=moment), check=False)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    if moment == "init":  # stopped at the first step boundary, with a checkpoint to resume from
        assert "SIGTERM received: stopping at step 0 and saving a resume checkpoint" in result.stdout
        assert os.path.exists(checkpoint_at(tmp_path, 0))
    else:
        assert os.path.exists(checkpoint_at(tmp_path, 1))


@pytest.mark.slow
def test_sigterm_while_the_script_imports_torch_exits_zero(data, launcher, tmp_path):
    # Half a second in, the script is still importing torch (main() has not run): the handler
    # installed before those imports turns the SIGTERM into a stop at the first step boundary.
    save_dir = tmp_path / "run"
    process = launcher.start(flags(data, save_dir, *STEPS), "importing", launcher=[sys.executable])  # a fresh process
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    assert launcher.wait(process) == 0, launcher.output(process)
    out, err = launcher.output(process)
    assert "Traceback" not in err and "SIGTERM received: stopping at step 0" in out
    assert os.path.exists(checkpoint_at(save_dir, 0))


@pytest.mark.slow
def test_ctrl_c_saves_at_the_next_step_and_a_second_ctrl_c_stops_now(data, launcher, tmp_path):
    save_dir = tmp_path / "once"
    args = flags(data, save_dir, *STEPS, "--from_resume", "1")
    process = launcher.start(args, "once")
    wait_until(lambda: metric_rows(save_dir) >= 2, process, launcher, what="two steps")
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole process group
    assert launcher.wait(process) == 0, launcher.output(process)
    out, err = launcher.output(process)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    stopped_at = int(out.split("SIGINT received: stopping at step ")[1].split()[0])
    assert 2 <= stopped_at < 10 and os.path.exists(checkpoint_at(save_dir, stopped_at))
    assert "stopped after SIGINT; continue with --from_resume 1" in out
    resumed = run_trainer_in_process(args, check=True)
    assert f"training 10 optimizer steps from step {stopped_at}" in resumed.stdout

    save_dir = tmp_path / "twice"
    process = launcher.start(flags(data, save_dir, *STEPS, "--max_steps", "1000", "--save_interval", "0"), "twice")
    wait_until(lambda: metric_rows(save_dir) >= 1, process, launcher, what="one step")
    os.killpg(process.pid, signal.SIGINT)
    wait_until(lambda: "press Ctrl-C again" in launcher.output(process)[1], process, launcher, what="the first Ctrl-C")
    os.killpg(process.pid, signal.SIGINT)
    assert launcher.wait(process) == 130
    out, err = launcher.output(process)
    assert "Traceback" not in err
    assert last_line(err) == "error: interrupted again (Ctrl-C): stopped now, without saving the steps since the last checkpoint"


@pytest.mark.slow
def test_sigterm_to_the_world_size_launcher_reaches_the_workers(data, launcher, tmp_path):
    save_dir = tmp_path / "run"
    args = flags(data, save_dir, "--batch_size", "2", "--max_steps", "10", "--save_interval", "0",
                 "--world_size", "2")
    process = launcher.start(args, "spawned")
    wait_until(lambda: metric_rows(save_dir) >= 2, process, launcher, what="two steps")
    os.kill(process.pid, signal.SIGTERM)  # the launcher's pid only
    assert launcher.wait(process) == 0, launcher.output(process)
    out, err = launcher.output(process)
    stopped_at = int(out.split("SIGTERM received: stopping at step ")[1].split()[0])
    assert 2 <= stopped_at < 10 and os.path.exists(checkpoint_at(save_dir, stopped_at))
    assert train_losses(save_dir) and final_weights(save_dir)


@pytest.mark.slow
def test_a_data_error_under_torchrun_is_printed_once_and_every_rank_exits_2(tmp_path):
    import re

    from tests.helpers.trainer_launch import TINY

    bad = tmp_path / "bad.jsonl"
    rows = open(os.path.join(REPO, "dataset", "demo", "sft_train.jsonl"), encoding="utf-8").readlines()[:5]
    bad.write_text("".join(rows) + '{"broken\n', encoding="utf-8")
    result = run_trainer([*TINY, "--data_path", str(bad), "--save_dir", str(tmp_path / "run"), "--cache_dir",
                          str(tmp_path / "cache")], nproc=2, check=False, launcher=torchrun_cmd(2))
    output = result.stdout + result.stderr
    line = f"error: {bad}:6: invalid JSON (Invalid control character at at column 9)"
    assert output.count(line) == 1, output[-3000:]
    assert "stopped: SIGTERM" not in output
    # no traceback of ours (torchrun's own names its files, which sit in a .venv inside the repo in CI)
    assert not re.search(rf'File "{re.escape(REPO)}/(?!\.venv/)', output), output[-3000:]
    assert re.findall(r"exitcode\s*: (\S+) \(pid", output) == ["2", "2"], output[-3000:]  # torchrun's report per rank


def test_a_missing_data_file_under_torchrun_is_printed_once_and_every_rank_exits_2(tmp_path):
    """Each rank finds the file missing on its own (no shared build outcome): the same line, once."""
    import re

    from tests.helpers.trainer_launch import TINY

    missing = tmp_path / "missing.jsonl"
    result = run_trainer([*TINY, "--data_path", str(missing), "--save_dir", str(tmp_path / "run")], nproc=2, check=False,
                         launcher=torchrun_cmd(2))
    output = result.stdout + result.stderr
    assert output.count(f"error: {missing}: data file not found") == 1, output[-3000:]
    assert re.findall(r"exitcode\s*: (\S+) \(pid", output) == ["2", "2"], output[-3000:]
