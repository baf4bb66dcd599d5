"""train_full_sft.py end to end in real processes (CPU, gloo): equivalences, multi-node, resume."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.in_process import run_in_process
from tests.helpers.record_dtypes import main_recording
from tests.helpers.trainer_launch import (
    REPO, SCRIPT, assert_weights_equal, checkpoint_at, clean_env, final_weights, finish, flags, free_port, run_ranks_apart,
    run_trainer, run_trainer_in_process, together, train_losses,
)

pytestmark = pytest.mark.slow

# Adam's first steps divide by |gradient|: an element whose gradient is ~1e-8 turns float
# reassociation noise into visible weight differences. A warmup keeps those below 1e-5.
STEPS = ["--max_steps", "3", "--save_interval", "0", "--learning_rate", "1e-3", "--warmup_steps", "10"]


@pytest.fixture(scope="module")
def one_process_batch_8(data, tmp_path_factory):
    """One process, batch 8, STEPS: the run that 2 ranks x 4, accumulation and every launch style must equal."""
    save_dir = tmp_path_factory.mktemp("single")
    run_trainer_in_process(flags(data, save_dir, "--batch_size", "8", *STEPS), check=True)
    return save_dir


@pytest.fixture(scope="module")
def two_ranks_batch_4(data, tmp_path_factory):
    """2 ranks x batch 4 started as `srun --ntasks 2` starts its tasks (SLURM_* set for each, MASTER_*
    given: no scontrol here), STEPS with a save at step 2 besides the last (a save reads the weights,
    it does not change them), each rank recording the files it writes (record_opens.py): the run that
    must equal one_process_batch_8, and whose rank 1 must write nothing. Rank 0's output: rank0.out."""
    folder = tmp_path_factory.mktemp("two_ranks")
    (folder / "report").mkdir()
    args = flags(data, folder / "run", "--batch_size", "4", *STEPS, "--save_interval", "2")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "helpers", "record_opens.py"), *args],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=clean_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                                            SLURM_JOB_ID="7", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                            MINISFT_WRITE_REPORT=str(folder / "report")))
             for rank in (0, 1)]
    ranks = finish(procs, timeout=180)
    assert [rank.returncode for rank in ranks] == [0, 0], [rank.stdout for rank in ranks]
    (folder / "rank0.out").write_text(ranks[0].stdout, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def one_step_run(data, tmp_path_factory):
    """One process, batch 4, 1 step: the checkpoint that the refused resumes start from."""
    save_dir = tmp_path_factory.mktemp("one_step")
    run_trainer_in_process(flags(data, save_dir, "--batch_size", "4", "--max_steps", "1"), check=True)
    return save_dir


def test_two_ranks_equal_one_rank_with_double_batch_and_accumulation_equals_bigger_batch(
        data, one_process_batch_8, two_ranks_batch_4, tmp_path):
    run_trainer_in_process(flags(data, tmp_path / "accum", "--batch_size", "4", "--accumulation_steps", "2", *STEPS),
                           check=True)
    one = final_weights(one_process_batch_8)
    assert_weights_equal(final_weights(two_ranks_batch_4 / "run"), one, atol=1e-5)
    assert_weights_equal(final_weights(tmp_path / "accum"), one, atol=1e-5)
    losses = train_losses(one_process_batch_8)
    for other in (two_ranks_batch_4 / "run", tmp_path / "accum"):
        assert sorted(train_losses(other)) == [1, 2, 3]
        for step, loss in train_losses(other).items():
            assert loss == pytest.approx(losses[step], abs=1e-5)
    # the training changed the weights (the equality above is not trivial)
    initial = torch.load(checkpoint_at(one_process_batch_8, 3), weights_only=True)
    assert initial["step"] == 3 and initial["samples_in_epoch"] == 24


def test_the_equivalence_runs_split_batches_of_unequal_loss_token_counts(data):
    """The first step of the runs above: its halves (2 ranks, or 2 micro-batches) carry different
    numbers of loss tokens, so a per-micro-batch mean would not give equal weights."""
    from dataset import ResumableDistributedSampler, SFTCollator, build_cache_and_open, load_tokenizer

    tokenizer = load_tokenizer(None)
    dataset = build_cache_and_open(data / "train.jsonl", tokenizer, 128)
    collate = SFTCollator(pad_token_id=tokenizer.pad_token_id)
    order = list(ResumableDistributedSampler(len(dataset), 1, 0, seed=42, lengths=dataset.lengths, group_size=8))

    def loss_tokens(indices):
        return int((collate([dataset[i] for i in indices])["labels"][:, 1:] != -100).sum())

    steps = [order[8 * k:8 * (k + 1)] for k in range(4)]
    assert any(loss_tokens(step[0::2]) != loss_tokens(step[1::2]) for step in steps)  # rank 0 vs rank 1
    assert any(loss_tokens(step[:4]) != loss_tokens(step[4:]) for step in steps)  # micro-batch 1 vs 2


@pytest.mark.parametrize("style", ["legacy_launch", "self_spawn"])
def test_other_launch_styles_train_the_same_as_one_process(data, one_process_batch_8, tmp_path, style):
    args = flags(data, tmp_path / style, "--batch_size", "4", *STEPS)
    if style == "legacy_launch":  # passes --local-rank to each worker
        run_trainer(args, launcher=[sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2",
                                    "--master_addr", "127.0.0.1", "--master_port", str(free_port())])
    else:  # seed 004's method C: the script starts its own workers
        run_trainer([*args, "--world_size", "2"])
    assert_weights_equal(final_weights(tmp_path / style), final_weights(one_process_batch_8), atol=1e-5)


def test_srun_tasks_train_the_same_as_one_process(two_ranks_batch_4, one_process_batch_8):
    """The launch style of two_ranks_batch_4: srun's tasks (SLURM_* in their environment)."""
    assert "2 processes x batch 4" in (two_ranks_batch_4 / "rank0.out").read_text(encoding="utf-8")
    assert_weights_equal(final_weights(two_ranks_batch_4 / "run"), final_weights(one_process_batch_8), atol=1e-5)


def test_bfloat16_autocast_on_cpu_trains_and_float16_is_refused(data, tmp_path):
    # Autocast is proven by the dtype of the matmul outputs inside the training step, not by the
    # losses differing (on a CPU without native bf16 they can coincide). 2 tiny steps: bf16 is
    # emulated, many times slower, on AVX2-only CPUs.
    # Each run in this process (autocast is a per-thread state its step enters and leaves), on one
    # thread as a trainer process would.
    def recorded(dtype):
        args = flags(data, tmp_path / dtype, "--batch_size", "4", "--max_steps", "2", "--dtype", dtype)
        done = run_in_process(["record_dtypes.py", *args],
                              lambda: main_recording(args, str(tmp_path / f"{dtype}.json")), threads=1)
        assert done.returncode == 0, done.stderr[-5000:]

    recorded("bfloat16")
    recorded("float32")
    result = run_trainer_in_process(flags(data, tmp_path / "fp16", "--max_steps", "1", "--dtype", "float16"))
    assert json.load(open(tmp_path / "bfloat16.json")) == ["torch.bfloat16"]
    assert json.load(open(tmp_path / "float32.json")) == ["torch.float32"]
    weights = final_weights(tmp_path / "bfloat16")
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights.values())  # fp32 master
    bf16, fp32 = train_losses(tmp_path / "bfloat16"), train_losses(tmp_path / "float32")
    for step in (1, 2):  # the same training, computed in bf16: close to fp32
        assert abs(bf16[step] - fp32[step]) < 0.02 * fp32[step]
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "error: --dtype float16 needs a GPU; on CPU use float32 or bfloat16"


@pytest.mark.parametrize("packing", ["0", "1"])
def test_torch_compile_trains_like_eager(data, tmp_path, packing):
    # Length-grouped batches of varying length (dynamic shapes) and packed rows (per-document
    # attention as a custom op in the compiled graph): compiled and eager runs follow the same losses.
    # The compiled packed run also recomputes activations (--gradient_checkpointing 1, the same
    # mathematics): the checkpoint is then traced with the block, the packed attention inside it.
    common = ["--batch_size", "4", "--max_steps", "4", "--packing", packing, "--save_interval", "0"]
    recompute = ["--gradient_checkpointing", "1"] if packing == "1" else []
    _, result = together(lambda: run_trainer_in_process(flags(data, tmp_path / "eager", *common), check=True),
                         lambda: run_trainer(flags(data, tmp_path / "compiled", *common, *recompute,
                                                   "--use_compile", "1"), timeout=600))
    assert "recompile_limit" not in result.stderr  # would mean it silently fell back to eager
    eager, compiled = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    assert sorted(eager) == sorted(compiled) == [1, 2, 3, 4]
    for step in eager:
        assert abs(eager[step] - compiled[step]) < 1e-4 * eager[step], (step, eager[step], compiled[step])
    assert_weights_equal(final_weights(tmp_path / "eager"), final_weights(tmp_path / "compiled"), atol=1e-4)


def test_wandb_offline_run_is_continued_after_resume(data, tmp_path):
    env = clean_env(WANDB_MODE="offline", WANDB_SILENT="true")
    common = ["--batch_size", "4", "--use_wandb", "1", "--save_interval", "2"]
    run_trainer(flags(data, tmp_path, *common, "--max_steps", "2"), env=env)
    run_trainer(flags(data, tmp_path, *common, "--max_steps", "4", "--from_resume", "1"), env=env)
    runs = sorted(name for name in os.listdir(tmp_path / "wandb") if name.startswith("offline-run-"))
    assert len(runs) == 2
    run_ids = {name.rsplit("-", 1)[-1] for name in runs}
    assert len(run_ids) == 1  # the resumed run continues the same wandb run
    assert torch.load(checkpoint_at(tmp_path, 4), weights_only=True)["wandb_run_id"] in run_ids


def test_two_torchrun_agents_as_two_nodes_train_together(data, one_process_batch_8, tmp_path):
    port = free_port()
    procs = []
    for node in (0, 1):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                    "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port)]
        args = flags(data, tmp_path / "nodes", "--batch_size", "4", *STEPS)
        procs.append(subprocess.Popen([*launcher, os.path.join(REPO, "train_full_sft.py"), *args], cwd=REPO,
                                      env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError("the two agents did not finish: " + " | ".join(p.communicate()[0][-2000:] for p in procs))
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "2 processes x batch 4" in outputs[0]
    assert_weights_equal(final_weights(tmp_path / "nodes"), final_weights(one_process_batch_8), atol=1e-5)


@pytest.mark.parametrize("workers", ["0", "2"])
def test_resume_after_k_steps_is_bit_identical(data, tmp_path, workers):
    # With MiniMind's augmentations on: they are drawn per (seed, epoch, sample), also in workers.
    # 5 steps, saved at 3, an eval at 2 and at 4: an eval before the save and one after it.
    common = ["--batch_size", "4", "--max_steps", "5", "--dropout", "0.1", "--num_workers", workers,
              "--eval_data_path", str(data / "eval.jsonl"), "--eval_interval", "2",
              "--system_prompt_ratio", "0.5", "--drop_empty_think_ratio", "0.5"]
    # in this process, but DataLoader workers are forked from a process of the run's own
    uninterrupted = run_trainer_in_process if workers == "0" else run_trainer
    uninterrupted(flags(data, tmp_path / "full", *common, "--save_interval", "3"), check=True)
    # The state a crash after step 3 leaves behind is the step-3 checkpoint: continue from it.
    resumed = run_trainer(flags(data, tmp_path / "resumed", *common, "--save_interval", "0",
                                "--resume_from", checkpoint_at(tmp_path / "full", 3)))
    assert "resuming from" in resumed.stdout and "training 5 optimizer steps from step 3" in resumed.stdout
    assert_weights_equal(final_weights(tmp_path / "resumed"), final_weights(tmp_path / "full"))
    assert torch.load(checkpoint_at(tmp_path / "full", 5), weights_only=True)["step"] == 5
    losses_full, losses_resumed = train_losses(tmp_path / "full"), train_losses(tmp_path / "resumed")
    assert all(losses_resumed[s] == losses_full[s] for s in (4, 5))


def test_resume_on_a_different_world_size_continues_the_same_sample_stream(data, tmp_path):
    common = ["--max_steps", "6"]
    run_trainer_in_process(flags(data, tmp_path / "full", "--batch_size", "4", *common, "--save_interval", "3"),
                           check=True)
    # same global batch (2 ranks x 2 = 1 rank x 4), so the same samples and the same mathematics
    # two ranks as two plain processes: the launcher is not what is checked
    ranks = run_ranks_apart(SCRIPT, flags(data, tmp_path / "resumed", "--batch_size", "2", *common, "--save_interval",
                                          "0", "--resume_from", checkpoint_at(tmp_path / "full", 3)), local_ranks=(0, 1))
    assert [rank.returncode for rank in ranks] == [0, 0], ranks
    assert "resuming a 1-process run on 2 processes" in ranks[0].stdout
    assert_weights_equal(final_weights(tmp_path / "resumed"), final_weights(tmp_path / "full"), atol=1e-5)


def test_from_resume_picks_the_latest_checkpoint_and_keeps_last(data, tmp_path):
    run_trainer_in_process(flags(data, tmp_path, "--batch_size", "4", "--max_steps", "5", "--save_interval", "1",
                                 "--keep_last", "2"), check=True)
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["step_00000004.pt", "step_00000005.pt"]
    again = run_trainer_in_process(flags(data, tmp_path, "--batch_size", "4", "--max_steps", "6", "--save_interval",
                                         "0", "--from_resume", "1"), check=True)
    assert "resuming from" in again.stdout and "step_00000005.pt" in again.stdout
    assert torch.load(checkpoint_at(tmp_path, 6), weights_only=True)["step"] == 6


def test_only_rank_zero_writes_files(two_ranks_batch_4):
    report, save_dir = two_ranks_batch_4 / "report", two_ranks_batch_4 / "run"
    rank0 = [p for p in json.load(open(report / "rank0.json")) if p.startswith(str(save_dir))]
    rank1 = [p for p in json.load(open(report / "rank1.json")) if p.startswith(str(save_dir))]
    assert any(p.endswith("step_00000002.pt") for p in rank0) and any(p.endswith("step_00000003.pt") for p in rank0)
    assert any(p.endswith("metrics.jsonl") for p in rank0)
    assert any(".model.tmp." in p and p.endswith("config.json") for p in rank0)  # inference weights
    assert str(save_dir / "model") in rank0  # renamed into place
    assert rank1 == []


def test_checkpoint_of_another_hidden_size_is_refused(data, one_step_run, tmp_path):
    other = [*flags(data, tmp_path / "b", "--batch_size", "4", "--max_steps", "2"), "--hidden_size", "64",
             "--resume_from", checkpoint_at(one_step_run, 1)]
    result = run_trainer_in_process(other)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: checkpoint model config differs from the flags: hidden_size (checkpoint 32, flags 64); "
        "head_dim (checkpoint 8, flags 16); intermediate_size (checkpoint 128, flags 256)"
    )
    assert "Traceback" not in result.stderr


def test_truncated_checkpoint_is_refused_with_a_clear_message(data, one_step_run, tmp_path):
    path = checkpoint_at(one_step_run, 1)
    content = open(path, "rb").read()
    broken = tmp_path / "broken.pt"
    broken.write_bytes(content[: len(content) // 2])
    result = run_trainer_in_process([*flags(data, tmp_path / "b", "--max_steps", "2"), "--resume_from", str(broken)])
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: resume checkpoint {broken} is corrupt or truncated")
    assert "Traceback" not in result.stderr


def test_ddp_neither_broadcasts_nor_reduces_the_rope_buffers():
    ranks = run_ranks_apart(os.path.join(REPO, "tests", "helpers", "ddp_buffers_check.py"), [], local_ranks=(0, 1),
                            timeout=180)
    assert [rank.returncode for rank in ranks] == [0, 0], [rank.stderr[-3000:] for rank in ranks]
    result = ranks[1]  # rank 1 reports
    assert "ignored: ['model.freqs_cos', 'model.freqs_sin']" in result.stdout
    assert "without ignore: rank 1 buffer overwritten by rank 0" in result.stdout
    assert "with ignore: rank 1 buffer kept" in result.stdout
    assert "gradients: 13 parameters in 1 bucket(s)" in result.stdout  # views of the bucket, no copies beside it
