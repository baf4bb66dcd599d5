"""`--fsdp 1` (FSDP2) end to end in real processes (CPU, gloo): the same mathematics as one process
and as DDP, sharded checkpoints that survive kill -9, resume on other process counts and across
DDP <-> FSDP, and the gathered inference weights."""

import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.overfitted import script_in_process
from tests.helpers.trainer_launch import (Launcher, REPO, assert_weights_equal, checkpoint_at, clean_env, flags,
                                         run_trainer, run_trainer_in_process, together, torchrun_cmd, train_losses,
                                         wait_until, worker_pids)
from trainer.checkpoint.resume import load_resume_checkpoint
from trainer.checkpoint.sharded import read_full

pytestmark = pytest.mark.slow

# Global batch 6 = 2 processes x 3 = 3 x 2 = 1 x 6; accumulation 2 splits it into micro-batches
# of unequal loss-token counts (tests/e2e/test_trainer.py checks the data has them).
STEPS = ["--max_steps", "4", "--learning_rate", "1e-3", "--warmup_steps", "10", "--accumulation_steps", "2",
         "--keep_last", "10"]


def dcp_at(save_dir, step: int) -> str:
    return os.path.join(save_dir, "checkpoints", f"step_{step:08d}.dcp")


def kill_job(job, launcher) -> None:
    """kill -9 of a torchrun job: its workers (in sessions of their own) and the agent."""
    for pid in worker_pids(job.pid).values():
        os.kill(pid, signal.SIGKILL)
    os.killpg(job.pid, signal.SIGKILL)
    assert launcher.wait(job) == -signal.SIGKILL


def weights(path) -> dict:
    """Full fp32 weights of a resume checkpoint, single file or sharded directory."""
    return load_resume_checkpoint(str(path), required=("model_config", "model"))["model"]


@pytest.fixture(scope="module")
def fsdp_run(data, tmp_path_factory):
    """The uninterrupted 2-process FSDP run, a checkpoint every step (the state each other run's is compared to)."""
    save_dir = tmp_path_factory.mktemp("fsdp") / "run"
    run_trainer(flags(data, save_dir, "--batch_size", "3", *STEPS, "--save_interval", "1", "--fsdp", "1",
                      "--save_dtype", "float32"), nproc=2)
    return save_dir


def test_fsdp_equals_one_process_and_ddp_and_resumes_a_ddp_checkpoint(data, fsdp_run, tmp_path):
    one, ddp = tmp_path / "one", tmp_path / "ddp"
    together(lambda: run_trainer_in_process(flags(data, one, "--batch_size", "6", *STEPS, "--save_interval", "2"),
                                            check=True),
             lambda: run_trainer(flags(data, ddp, "--batch_size", "3", *STEPS, "--save_interval", "0"), nproc=2))
    reference = weights(checkpoint_at(one, 4))
    assert os.path.isdir(dcp_at(fsdp_run, 4))  # sharded: one file per rank
    assert sorted(n for n in os.listdir(dcp_at(fsdp_run, 4)) if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    fsdp_final = weights(dcp_at(fsdp_run, 4))
    assert_weights_equal(fsdp_final, reference, atol=1e-5)
    assert_weights_equal(weights(checkpoint_at(ddp, 4)), fsdp_final, atol=1e-5)
    losses = train_losses(one)
    assert train_losses(fsdp_run) == pytest.approx(losses, abs=1e-5)
    assert not torch.equal(weights(checkpoint_at(one, 2))["model.norm.weight"], reference["model.norm.weight"])
    # out/model holds exactly the gathered final weights (tied lm_head stored once)
    saved = load_file(os.path.join(fsdp_run, "model", "model.safetensors"))
    for name, tensor in saved.items():
        assert torch.equal(tensor, fsdp_final[name]), name
    # the inference loader reads a sharded checkpoint too
    from trainer.weights.inference import load_model_for_inference

    model = load_model_for_inference(dcp_at(fsdp_run, 4))
    assert torch.equal(model.state_dict()["model.norm.weight"], fsdp_final["model.norm.weight"])
    # a single-file (DDP / one-process) checkpoint continues under FSDP
    resumed = run_trainer(flags(data, tmp_path / "from_pt", "--batch_size", "3", *STEPS, "--save_interval", "0",
                                "--fsdp", "1", "--resume_from", checkpoint_at(one, 2)), nproc=2)
    assert "resuming a 1-process run on 2 processes" in resumed.stdout
    assert_weights_equal(weights(dcp_at(tmp_path / "from_pt", 4)), reference, atol=1e-5)


def test_compiled_fsdp_trains_like_eager_fsdp(data, fsdp_run, tmp_path):
    # --use_compile 1 compiles the fully_shard-ed model (trainer/parallel/fsdp.py): the same 4 steps with
    # accumulation 2 as the eager fsdp_run. Tolerance 1e-5 (fp32, as for 2 processes vs 1):
    # Inductor fuses the norms, softmax and matmul epilogues and so sums in another order; the
    # difference is rounding (measured 8e-8 on the weights, losses equal to the printed digit).
    compiled = tmp_path / "compiled"
    result = run_trainer(flags(data, compiled, "--batch_size", "3", *STEPS, "--save_interval", "2", "--fsdp", "1",
                               "--save_dtype", "float32", "--use_compile", "1"), nproc=2, timeout=900)
    assert "recompile_limit" not in result.stderr  # would mean it silently fell back to eager
    assert sorted(os.listdir(dcp_at(compiled, 4))) == sorted(os.listdir(dcp_at(fsdp_run, 4)))  # still sharded
    assert_weights_equal(weights(dcp_at(compiled, 4)), weights(dcp_at(fsdp_run, 4)), atol=1e-5)
    eager = train_losses(fsdp_run)
    assert sorted(eager) == [1, 2, 3, 4]
    assert train_losses(compiled) == pytest.approx(eager, rel=1e-5)
    assert not torch.equal(weights(dcp_at(compiled, 2))["model.norm.weight"], weights(dcp_at(compiled, 4))["model.norm.weight"])


@pytest.mark.parametrize("nproc,batch,fsdp", [(1, 6, "1"), (3, 2, "1"), (2, 3, "0")])
def test_a_sharded_checkpoint_resumes_on_other_process_counts_and_under_ddp(data, fsdp_run, tmp_path, nproc, batch, fsdp):
    # the 3-process FSDP run also recomputes activations (--gradient_checkpointing 1): same weights
    recompute = ["--gradient_checkpointing", "1"] if nproc == 3 else []
    args = flags(data, tmp_path, "--batch_size", str(batch), *STEPS, "--save_interval", "0", *recompute,
                 "--fsdp", fsdp, "--resume_from", dcp_at(fsdp_run, 2))
    # one process: the trainer's main in this process (what is checked is the checkpoint's reading, not a process)
    resumed = run_trainer_in_process(args, check=True) if nproc == 1 else run_trainer(args, nproc=nproc)
    assert "training 4 optimizer steps from step 2" in resumed.stdout
    final = checkpoint_at(tmp_path, 4) if nproc == 1 or fsdp == "0" else dcp_at(tmp_path, 4)
    assert_weights_equal(weights(final), weights(dcp_at(fsdp_run, 4)), atol=1e-5)
    full = train_losses(fsdp_run)
    # the same samples after the resume point: the same losses
    assert train_losses(tmp_path) == pytest.approx({step: full[step] for step in (3, 4)}, abs=1e-5)


def test_fsdp_killed_after_its_first_checkpoint_resumes_bit_identical(data, fsdp_run, tmp_path):
    launcher = Launcher(tmp_path)
    for attempt in range(3):  # on a crowded machine the kill can land after the run's end: try again
        save_dir = tmp_path / f"run{attempt}"
        args = flags(data, save_dir, "--batch_size", "3", *STEPS, "--save_interval", "2", "--fsdp", "1",
                     "--save_dtype", "float32", "--from_resume", "1")
        try:
            job = launcher.start(args, f"killed{attempt}", nproc=2)
            wait_until(lambda: os.path.isdir(dcp_at(save_dir, 2)), job, launcher, what="the first checkpoint")
            kill_job(job, launcher)
        finally:
            launcher.stop_all()
        if not os.path.exists(dcp_at(save_dir, 4)):
            break
    assert not os.path.exists(dcp_at(save_dir, 4)), "the kill never landed before the end of the run"
    finished = run_trainer(args, nproc=2)
    assert "resuming from" in finished.stdout and "step_00000002.dcp" in finished.stdout
    assert "schedule" not in finished.stdout  # the sharded optimizer state gives the learning rate of its step
    assert_weights_equal(weights(dcp_at(save_dir, 4)), weights(dcp_at(fsdp_run, 4)))  # bit-identical


@pytest.mark.parametrize("nproc,batch,fsdp", [(2, "3", "1"), (1, "6", "0")], ids=["sharded", "one-process"])
def test_a_run_stopped_before_its_first_step_resumes_under_fsdp_bit_identical(data, fsdp_run, tmp_path, nproc, batch,
                                                                              fsdp):
    """A SIGTERM before the first step (tests/helpers/signal_self.py) leaves a checkpoint of step 0, sharded
    or a one-process file. Resumed under FSDP, the optimizer has not stepped, as in the uninterrupted run,
    which the resumed run ends equal to, bit for bit (an AdamW counter at 1 makes the first update x0.73)."""
    stopped, resumed = tmp_path / "stopped", tmp_path / "resumed"
    result = run_trainer(flags(data, stopped, "--batch_size", batch, *STEPS, "--save_interval", "2", "--fsdp", fsdp),
                         nproc=nproc, script=os.path.join(REPO, "tests", "helpers", "signal_self.py"),
                         env=clean_env(MINISFT_TEST_SIGTERM_AT="init"))
    assert "SIGTERM received: stopping at step 0" in result.stdout
    if fsdp == "1":  # AdamW's counters in the shards: no step taken
        checkpoint = dcp_at(stopped, 0)
        steps = [value for key, value in read_full(checkpoint, "optimizer").items() if key.endswith(".step")]
        assert steps and all(step.item() == 0 for step in steps)
    else:
        checkpoint = checkpoint_at(stopped, 0)
    run_trainer(flags(data, resumed, "--batch_size", "3", *STEPS, "--save_interval", "0", "--fsdp", "1",
                      "--resume_from", checkpoint), nproc=2)
    assert_weights_equal(weights(dcp_at(resumed, 4)), weights(dcp_at(fsdp_run, 4)))


# What a checkpoint records of its run, not of its training state: its flags (--save_dir), id, place on disk.
RUN_RECORDS = ("args", "run_id", "forked_from", "rolled_back_from", "wandb_run_id", "sharded_path")


def assert_same(a, b, where="") -> None:
    """`a` and `b` (nested dicts and lists of tensors and plain values) equal, tensors bit for bit."""
    if isinstance(a, (dict, list, tuple)):
        assert type(a) is type(b) and len(a) == len(b) and (type(a) is not dict or a.keys() == b.keys()), where
        for key in a if isinstance(a, dict) else range(len(a)):
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def training_state(path) -> dict:
    """Everything of a sharded checkpoint that a resume goes on from: its non-tensor entries and its model and
    optimizer shards, read whole."""
    saved = load_resume_checkpoint(str(path))
    return {**{key: value for key, value in saved.items() if key not in RUN_RECORDS},
            "model": read_full(str(path), "model"), "optimizer": read_full(str(path), "optimizer")}


def test_the_loop_trains_on_while_the_shards_are_written_and_they_hold_their_step(data, fsdp_run, tmp_path):
    """DCP's async_save: the shards of step 2 are held back (tests/helpers/held_shards.py) until the
    loop of their rank has taken step 4; they still hold step 2's state, bit for bit: everything a
    resume reads (model and optimizer shards, step, sampler position, RNG states) equals the uninterrupted
    run's checkpoint of that step, from which a resume ends where that run does, bit for bit
    (test_fsdp_killed_after_its_first_checkpoint_resumes_bit_identical)."""
    save_dir = tmp_path / "held"
    held = run_trainer(flags(data, save_dir, "--batch_size", "3", *STEPS, "--save_interval", "2", "--fsdp", "1",
                             "--save_dtype", "float32"), nproc=2, script=os.path.join(REPO, "tests", "helpers", "held_shards.py"))
    for rank in (0, 1):
        assert f"rank {rank}: shards of step 2 written after step 4" in held.stdout, held.stdout[-2000:]
    for step in (2, 4):
        state = training_state(dcp_at(save_dir, step))
        assert state["step"] == step and state["optimizer"]
        assert_same(state, training_state(dcp_at(fsdp_run, step)), f"step {step}")


def test_a_sigterm_while_shards_are_written_waits_for_them_and_saves_its_step(data, fsdp_run, tmp_path):
    """Step 2's shards are held until step 3 is taken, when rank 1 gets a SIGTERM: the stop's save
    of step 3 waits for them, is written before exit 0, and holds, bit for bit, everything a resume
    reads of the uninterrupted run's step 3 (so a resume ends where that run does)."""
    save_dir = tmp_path / "stopped"
    stopped = run_trainer(flags(data, save_dir, "--batch_size", "3", *STEPS, "--save_interval", "2", "--fsdp", "1",
                                "--save_dtype", "float32"),
                          nproc=2, script=os.path.join(REPO, "tests", "helpers", "held_shards.py"),
                          env=clean_env(MINISFT_TEST_RELEASE_AT="3", MINISFT_TEST_SIGTERM_AT="3"))
    assert "stopping at step 3" in stopped.stdout and "shards of step 2 written after step 3" in stopped.stdout
    assert sorted(os.listdir(save_dir / "checkpoints")) == ["step_00000002.dcp", "step_00000003.dcp"]
    state = training_state(dcp_at(save_dir, 3))
    assert state["step"] == 3
    assert_same(state, training_state(dcp_at(fsdp_run, 3)), "step 3")


def test_a_shard_write_failing_on_rank_1_stops_every_rank_with_its_one_line_reason(data, tmp_path):
    """The write of step 4 fails on rank 1 in the background (tests/helpers/failing_shards.py): both
    ranks stop at the next save with rank 1's reason (one line), exit 2; step 2's checkpoint is still whole."""
    save_dir = tmp_path / "run"
    result = run_trainer(flags(data, save_dir, "--batch_size", "3", "--max_steps", "8", "--save_interval", "2",
                               "--fsdp", "1"), nproc=2, check=False,
                         script=os.path.join(REPO, "tests", "helpers", "failing_shards.py"),
                         env=clean_env(MINISFT_TEST_FAIL_SAVE_AT="2", MINISFT_TEST_FAIL_RANK="1"))
    line = f"error: could not write the sharded checkpoint {dcp_at(save_dir, 4)}: rank 1: [Errno 28] No space left on device"
    assert result.stderr.count(line) == 1, result.stderr[-3000:]  # both ranks fail with it: printed once
    assert "exitcode  : 2" in result.stderr
    assert sorted(n for n in os.listdir(save_dir / "checkpoints") if n.endswith(".dcp")) == ["step_00000002.dcp"]
    assert load_resume_checkpoint(dcp_at(save_dir, 2))["step"] == 2


def test_kill_during_a_sharded_save_keeps_the_previous_checkpoint(data, tmp_path):
    launcher = Launcher(tmp_path)
    save_dir = tmp_path / "run"
    folder = save_dir / "checkpoints"
    def args(max_steps):
        return flags(data, save_dir, "--batch_size", "3", "--max_steps", str(max_steps), "--save_interval", "1",
                     "--fsdp", "1", "--keep_last", "2", "--from_resume", "1")

    def inside_a_save():
        names = os.listdir(folder) if folder.is_dir() else []
        return any(n.endswith(".dcp") for n in names) and any(n.endswith(".dcp.tmp") for n in names)

    try:
        job = launcher.start(args(30), "killed", nproc=2)
        wait_until(inside_a_save, job, launcher, what="a sharded save in progress")
        kill_job(job, launcher)
    finally:
        launcher.stop_all()
    names = sorted(os.listdir(folder))
    assert any(n.endswith(".dcp.tmp") for n in names), "the kill did not land inside a save"
    complete = sorted(n for n in names if n.endswith(".dcp"))
    newest = folder / complete[-1]
    step = int(complete[-1][5:13])
    assert load_resume_checkpoint(str(newest))["step"] == step
    assert set(weights(newest)) == set(weights(folder / complete[0]))
    finished = run_trainer(args(step + 1), nproc=2)
    assert f"resuming from {newest}" in finished.stdout
    assert not any(n.endswith(".tmp") for n in os.listdir(folder))  # the killed save's leftover is gone
    assert load_resume_checkpoint(dcp_at(save_dir, step + 1))["step"] == step + 1


def test_chat_eval_and_export_read_a_sharded_checkpoint(data, fsdp_run, tmp_path):
    """docs/fsdp.md: a step_*.dcp directory, and a run directory whose newest checkpoint is one, serve as
    --model_path: the weights are the shards' (equal to the model/ the run saved from them), the tokenizer
    the one the run recorded."""
    from trainer.weights.inference import load_model_for_inference, load_tokenizer_for_model

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sharded = dcp_at(fsdp_run, 4)
    no_model = tmp_path / "crashed_before_model"  # a run directory with nothing but sharded checkpoints
    shutil.copytree(fsdp_run / "checkpoints", no_model / "checkpoints")
    saved = load_file(fsdp_run / "model" / "model.safetensors")  # --save_dtype float32, at step 4
    for path in (sharded, no_model):
        state = load_model_for_inference(path).state_dict()
        assert_weights_equal({k: v for k, v in state.items() if k in saved}, saved)
        assert load_tokenizer_for_model(path).chat_template == load_tokenizer_for_model(fsdp_run).chat_template
    from dataset.rendering import tokenizer_fingerprint
    from trainer.weights.read import saved_tokenizer

    own = saved_tokenizer(str(sharded))  # the meta.pt holds a copy of the run's tokenizer, as a .pt does
    assert own.files and own.fingerprint == tokenizer_fingerprint(load_tokenizer_for_model(sharded))

    def script(name, *args):
        return subprocess.run([sys.executable, os.path.join(repo, "scripts", name), *args, "--device", "cpu"],
                              cwd=repo, capture_output=True, text=True, timeout=300)

    chat = script("chat.py", "--model_path", sharded, "--prompt", "Hi", "--temperature", "0", "--max_new_tokens", "4")
    assert chat.returncode == 0 and chat.stderr == "", chat.stderr
    # eval_sft.py and export_hf.py as their __main__ runs them, in this process
    evaluated = script_in_process("eval_sft.py", "--model_path", str(no_model), "--data_path", str(data / "eval.jsonl"),
                                  "--device", "cpu")
    assert evaluated.returncode == 0 and '"num_conversations": 16' in evaluated.stdout, evaluated.stderr
    exported = script_in_process("export_hf.py", "--model_path", sharded, "--out_dir", str(tmp_path / "export"),
                                 "--device", "cpu")
    assert exported.returncode == 0, exported.stderr
    assert_weights_equal(load_file(tmp_path / "export" / "model.safetensors"), saved)


def test_fsdp_refuses_what_it_cannot_do_with_one_line_errors():
    from types import SimpleNamespace

    from trainer.runtime.distributed import DistContext
    from trainer.errors import ConfigError
    from trainer.parallel import build_parallelism
    from trainer.parallel.ddp import Replicated

    two = DistContext(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"), backend="gloo")
    one = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None)
    with pytest.raises(ConfigError, match="--dtype bfloat16"):
        build_parallelism(SimpleNamespace(fsdp=1), two, torch.float16)
    # one process has nothing to shard: it trains as without --fsdp
    assert isinstance(build_parallelism(SimpleNamespace(fsdp=1), one, torch.float32), Replicated)


def test_a_truncated_shard_is_skipped_and_a_checkpoint_that_does_not_fit_is_one_line(data, fsdp_run, tmp_path):
    """A shard cut short: --from_resume 1 warns and resumes from the checkpoint before, in one process without
    torch's warning. Shards whose tensors are not the model's (layer 1 left out of DCP's index): one line
    counting the missing tensors and naming the first, as for a single-file checkpoint."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    run = tmp_path / "run"
    shutil.copytree(fsdp_run, run)
    shard = os.path.join(dcp_at(run, 4), "__1_0.distcp")
    size = os.path.getsize(shard)
    os.truncate(shard, 1000)
    resumed = run_trainer(flags(data, run, "--batch_size", "6", *STEPS, "--max_steps", "5", "--from_resume", "1",
                                "--save_interval", "0"))
    assert (f"warning: skipping unusable checkpoint: sharded checkpoint {dcp_at(run, 4)} is truncated (__1_0.distcp "
            f"holds 1000 bytes, its index needs {size}); falling back to the previous one") in resumed.stdout.splitlines()
    assert f"resuming from {dcp_at(run, 3)} (step 3," in resumed.stdout
    assert "Warning" not in resumed.stderr and "Traceback" not in resumed.stderr, resumed.stderr
    index = os.path.join(dcp_at(run, 2), ".metadata")
    metadata = FileSystemReader(dcp_at(run, 2)).read_metadata()  # our own file: DCP's reader unpickles it
    metadata.state_dict_metadata = {key: value for key, value in metadata.state_dict_metadata.items()
                                    if not key.startswith("model.model.layers.1.")}
    with open(index, "wb") as handle:
        pickle.dump(metadata, handle)
    refused = run_trainer_in_process(flags(data, tmp_path / "other", "--batch_size", "6", *STEPS,
                                           "--resume_from", dcp_at(run, 2)))
    assert (refused.returncode, refused.stderr.splitlines()[-1]) == (2, (
        "error: resume checkpoint does not fit this run: missing 11 tensors (model.layers.1.input_layernorm.weight, "
        "model.layers.1.self_attn.q_proj.weight, model.layers.1.self_attn.k_proj.weight, ...)"))


def test_a_sharded_checkpoint_that_would_run_code_is_refused_and_skipped(data, fsdp_run, tmp_path):
    """The newest step_*.dcp of a 2-process run with a crafted index (.metadata), or with a non-tensor entry of
    its shards (the optimizer's lr) that runs a shell command when unpickled: --from_resume 1 warns and resumes
    from the checkpoint before, --resume_from refuses it in one line; the command never runs."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.helpers.malicious_pickle import RunsCode, malicious_dcp_index

    marker = tmp_path / "code_ran"
    runs = {"index": tmp_path / "index", "entry": tmp_path / "entry"}
    for run in runs.values():
        shutil.copytree(fsdp_run, run)
    malicious_dcp_index(dcp_at(runs["index"], 4), marker)
    entry = dcp_at(runs["entry"], 4)
    dcp_to_torch_save(entry, tmp_path / "flat.pt")
    state = torch.load(tmp_path / "flat.pt", weights_only=True)
    state["optimizer"]["param_groups"][0]["lr"] = RunsCode(marker)
    shutil.copy(os.path.join(entry, "meta.pt"), tmp_path / "meta.pt")
    shutil.rmtree(entry)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=entry, no_dist=True)
    shutil.copy(tmp_path / "meta.pt", os.path.join(entry, "meta.pt"))
    refusals = {
        "index": (f"refused to load {dcp_at(runs['index'], 4)}/.metadata: it contains Python objects (posix.system) "
                  "that a safe load of DCP's index does not allow; it is not a minisft checkpoint and may be malicious"),
        "entry": (f"refused to load {entry}/__0_0.distcp: its entry optimizer.param_groups.0.lr holds Python objects "
                  "that a safe (weights_only) load does not allow; it is not a minisft checkpoint and may be malicious"),
    }
    for name, run in runs.items():
        refused = run_trainer_in_process(flags(data, tmp_path / f"other_{name}", "--batch_size", "6", *STEPS,
                                               "--resume_from", dcp_at(run, 4)))
        assert (refused.returncode, refused.stderr.splitlines()[-1]) == (2, f"error: {refusals[name]}"), refused.stderr
        assert "Traceback" not in refused.stderr and "training" not in refused.stdout
        resumed = run_trainer_in_process(flags(data, run, "--batch_size", "6", *STEPS, "--max_steps", "4",
                                               "--from_resume", "1", "--save_interval", "0"), check=True)
        assert (f"warning: skipping unusable checkpoint: {refusals[name]}; falling back to the previous one"
                in resumed.stdout.splitlines()), resumed.stdout[-3000:]
        assert f"resuming from {dcp_at(run, 3)} (step 3," in resumed.stdout
        assert "Traceback" not in resumed.stderr, resumed.stderr
    assert not marker.exists()


def rewritten(checkpoint, target, change) -> str:
    """A copy of the sharded `checkpoint` whose model tensors `change(model)` alters (one shard, as one process
    writes it: any process count loads it)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    os.makedirs(target.parent / "flat", exist_ok=True)
    flat = target.parent / "flat" / f"{target.name}.pt"
    dcp_to_torch_save(checkpoint, flat)
    state = torch.load(flat, weights_only=True)
    change(state["model"])
    torch.save(state, flat)
    torch_save_to_dcp(flat, target)
    shutil.copy(os.path.join(checkpoint, "meta.pt"), target / "meta.pt")
    return str(target)


def test_a_sharded_checkpoint_that_does_not_fit_is_refused_as_a_single_file_one_is(data, fsdp_run, tmp_path):
    """The check of every weights loader (trainer/weights/read.py, `misfit`) before the shards load: a tied
    model's lm_head.weight apart from its embedding (one of the two would be lost), an extra tensor (dropped
    without a word) and a wrong shape are one line, from every rank of an --fsdp 1 run and from one process.
    Rank 0 alone reads the two tied tensors (tests/helpers/record_opens.py records the files each rank
    opens): rank 1 reads the checkpoint's index, and its shard once, for the non-tensor entries that every
    rank checks (trainer/checkpoint/dcp_reading.py); rank 0 reads the shard once more, for the tensors."""
    def apart(model):
        model["lm_head.weight"] += 1

    def extra_and_wrong_shape(model):
        model["model.extra.weight"] = torch.zeros(2)
        model["model.norm.weight"] = torch.ones(3)

    line = ("error: resume checkpoint does not fit this run: lm_head.weight differs from model.embed_tokens.weight, "
            "which is the same tensor in a model with tie_word_embeddings")
    resume = ["--batch_size", "3", *STEPS, "--fsdp", "1", "--resume_from"]
    report = tmp_path / "report"
    report.mkdir()
    checkpoint = rewritten(dcp_at(fsdp_run, 2), tmp_path / "apart.dcp", apart)
    result = run_trainer(flags(data, tmp_path / "apart", *resume, checkpoint), nproc=2, check=False,
                         launcher=torchrun_cmd(2),  # the exit code of each rank, as torchrun reports them
                         script=os.path.join(REPO, "tests", "helpers", "record_opens.py"),
                         env=clean_env(MINISFT_WRITE_REPORT=str(report)))
    output = result.stdout + result.stderr
    assert output.count(line) == 1, output[-3000:]  # both ranks refuse: printed once
    assert re.findall(r"exitcode\s*: (\S+) \(pid", output) == ["2", "2"], output[-3000:]
    opened = {rank: [os.path.relpath(path, checkpoint) for path in (report / f"rank{rank}.reads.txt")
                     .read_text().splitlines() if path.startswith(checkpoint + os.sep)] for rank in (0, 1)}
    assert {rank: sorted(set(names)) for rank, names in opened.items()} == {
        0: [".metadata", "__0_0.distcp", "meta.pt"], 1: [".metadata", "__0_0.distcp", "meta.pt"]}
    assert {rank: names.count("__0_0.distcp") for rank, names in opened.items()} == {0: 2, 1: 1}, opened
    refused = run_trainer_in_process(flags(data, tmp_path / "shapes", *resume, rewritten(
        dcp_at(fsdp_run, 2), tmp_path / "shapes.dcp", extra_and_wrong_shape)))
    assert (refused.returncode, refused.stderr.splitlines()) == (2, [
        "error: resume checkpoint does not fit this run: unexpected 1 tensor (model.extra.weight); wrong shape 1 "
        "tensor (model.norm.weight)"])
