"""Resume and checkpoint integrity: the sample stream across a resume with another global batch,
refused changes of the stream, rollbacks, one run per --save_dir, damaged or foreign resume files.
docs/reliability.md maps each case to its test."""

import hashlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from dataset import ResumableDistributedSampler, load_tokenizer
from tests.helpers.trainer_launch import (
    REPO, TINY, checkpoint_at, clean_env, flags, run_trainer, run_trainer_in_process,
)
from trainer import run_identity
from trainer.args import parse_args
from trainer.checkpoint.resume import find_resume_checkpoint, load_resume_checkpoint
from trainer.checkpoint.save_dir import claim_for_fresh_run, SaveDirLock
from trainer.errors import CheckpointError
from trainer.data_setup import build_train_data
from trainer.runtime.seeding import capture_rng_state, cuda_state_for, restore_rng_state

# --------------------------------------------------------------------------- the sample stream


def global_order_after(sampler: ResumableDistributedSampler, world_size: int, epoch: int, start: int) -> list[int]:
    """The union of every rank's samples for the rest of the epoch, in global order (rank r of
    micro-batch j holds positions j*B*W + r ... interleaved), as the loop iterates them."""
    per_rank = []
    for rank in range(world_size):
        sampler.rank, sampler.num_replicas = rank, world_size
        sampler.set_epoch(epoch)
        sampler.set_start_index(start)
        per_rank.append(list(sampler))
    return [index for column in zip(*per_rank) for index in column]


@pytest.mark.parametrize("new_world, new_group", [(1, 4), (4, 16), (2, 4), (2, None)])
def test_a_resume_with_another_global_batch_sees_every_sample_of_the_epoch_once(new_world, new_group):
    """2 ranks x 4 (groups of 8) stopped after 5 steps, resumed on 1 rank x 4, 4 ranks x 4,
    2 ranks x 2 (a changed --batch_size) and without length grouping."""
    lengths = torch.randint(5, 300, (120,), generator=torch.Generator().manual_seed(1)).numpy()
    old = ResumableDistributedSampler(len(lengths), num_replicas=2, rank=0, seed=3, lengths=lengths, group_size=8)
    consumed = global_order_after(old, 2, epoch=0, start=0)[: 5 * 8]
    new = ResumableDistributedSampler(len(lengths), num_replicas=new_world, rank=0, seed=3, lengths=lengths,
                                      group_size=new_group)
    unpinned = global_order_after(new, new_world, epoch=0, start=len(consumed))[: len(lengths) - len(consumed)]
    assert sorted(consumed + unpinned) != list(range(len(lengths)))  # what resuming in the new order did
    new.pin_epoch_grouping(0, 8)
    rest = global_order_after(new, new_world, epoch=0, start=len(consumed))
    assert sorted(consumed + rest) == list(range(len(lengths)))  # 120 divides by every world size here
    # the next epoch is ordered with the new grouping
    assert global_order_after(new, new_world, epoch=1, start=0) == global_order_after(
        ResumableDistributedSampler(len(lengths), num_replicas=1, rank=0, seed=3, lengths=lengths,
                                    group_size=new_group), new_world, epoch=1, start=0)


@pytest.fixture(scope="module")
def two_rank_run(data, tmp_path_factory):
    """A real 2 ranks x batch 4 run stopped (checkpointed) after 3 steps: 24 of 90 samples."""
    save_dir = tmp_path_factory.mktemp("two_ranks")
    run_trainer(flags(data, save_dir, "--batch_size", "4", "--max_steps", "3", "--save_interval", "3"), nproc=2)
    return save_dir


def replay_epoch(argv: list[str], world_size: int, saved: dict | None) -> list[int]:
    """The epoch's samples (global order) as the trainer's own data setup and resume logic order them."""
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer_path)
    data = build_train_data(args, tokenizer, SimpleNamespace(world_size=world_size, rank=0, local_rank=0, device=torch.device("cpu")))
    if saved is None:
        return global_order_after(data.sampler, world_size, epoch=0, start=0)
    messages = []
    assert run_identity.check_and_pin(saved, data.identity, args.save_dir, data.sampler, messages.append) is None
    assert messages and messages[0].startswith("finishing epoch 1 in the checkpoint's order (length groups of 8")
    return global_order_after(data.sampler, world_size, epoch=saved["epoch"], start=saved["samples_in_epoch"])


def samples_in(data) -> int:
    """Samples of the test data set at the TINY flags' --max_seq_len (from the trainer's own data setup)."""
    return len(build_train_data(parse_args(flags(data, "unused")), load_tokenizer(None),
                                SimpleNamespace(world_size=1, rank=0, local_rank=0, device=torch.device("cpu"))).dataset)


@pytest.mark.slow
@pytest.mark.parametrize("world_size, batch", [(1, 4), (4, 4), (2, 3)])
def test_real_two_rank_checkpoint_resumed_on_other_global_batches_covers_the_epoch_once(
        data, two_rank_run, tmp_path, world_size, batch):
    saved = load_resume_checkpoint(checkpoint_at(two_rank_run, 3))
    assert saved["sample_stream"]["epoch_grouping"] == 8 and saved["samples_in_epoch"] == 24
    consumed = replay_epoch(flags(data, two_rank_run, "--batch_size", "4"), 2, None)[:24]
    rest = replay_epoch(flags(data, tmp_path, "--batch_size", str(batch)), world_size, saved)
    total = samples_in(data)
    assert sorted(consumed + rest[: total - 24]) == list(range(total))
    assert len(rest) - (total - 24) == -(total - 24) % world_size  # only the usual padding to the world size


@pytest.mark.slow
def test_resume_with_a_changed_batch_size_trains_the_rest_of_the_epoch(data, two_rank_run, tmp_path):
    resumed = run_trainer_in_process(flags(data, tmp_path, "--batch_size", "6", "--save_interval", "0",
                                           "--resume_from", checkpoint_at(two_rank_run, 3)), check=True)
    assert "finishing epoch 1 in the checkpoint's order (length groups of 8; now 6)" in resumed.stdout
    last = 3 + -(-(samples_in(data) - 24) // 6)  # the rest of the epoch in batches of 6
    assert f"training {last} optimizer steps from step 3" in resumed.stdout
    final = load_resume_checkpoint(checkpoint_at(tmp_path, last))
    assert (final["epoch"], final["samples_in_epoch"]) == (1, 0)
    assert final["sample_stream"]["epoch_grouping"] == 6  # epoch 2, not started: this run's grouping
    # Saved at the step that ended an epoch, the next one is ordered by the resuming run's grouping,
    # also where a checkpoint records the ended epoch's grouping for it.
    final["sample_stream"]["epoch_grouping"] = 8
    torch.save(final, tmp_path / "boundary.pt")
    again = run_trainer_in_process(flags(data, tmp_path / "again", "--batch_size", "6", "--epochs", "2",
                                         "--save_interval", "0", "--resume_from", str(tmp_path / "boundary.pt")),
                                   check=True)
    assert "finishing epoch" not in again.stdout, again.stdout
    assert f"training {last + -(-samples_in(data) // 6)} optimizer steps from step {last}" in again.stdout


@pytest.mark.slow
def test_resume_with_another_seed_or_data_file_is_refused(data, two_rank_run, tmp_path):
    small = tmp_path / "small.jsonl"
    small.write_text("".join(open(data / "train.jsonl", encoding="utf-8").readlines()[:40]), encoding="utf-8")
    resume = ["--resume_from", checkpoint_at(two_rank_run, 3)]
    cases = {
        "seed": ([*flags(data, tmp_path / "seed", "--batch_size", "4"), "--seed", "7", *resume],
                 "error: cannot resume: --seed differs from the checkpoint's run (checkpoint 42, now 7), so its "
                 "position in the epoch would mean other samples; resume with --seed 42, or start a new run from "
                 f"its weights with --from_weight {two_rank_run / 'model'} --save_dir NEW_DIR"),
        "data": ([*flags(data, tmp_path / "data", "--batch_size", "4"), "--data_path", str(small), *resume],
                 "error: cannot resume: --data_path content differs from the checkpoint's run (checkpoint "),
    }
    for name, (argv, _) in cases.items():
        refused = run_trainer_in_process(argv)
        out, err = refused.stdout, refused.stderr
        assert refused.returncode == 2, (name, err)
        line = err.strip().splitlines()[-1]
        assert line.startswith(cases[name][1]), line
        assert "Traceback" not in err and "training" not in out
    assert f"resume with the data it was trained on ({data / 'train.jsonl'}, unchanged)" in line
    assert not os.path.exists(tmp_path / "data" / "checkpoints")


def identity_of(tmp_path, **flags):
    """The run identity of TINY flags (plus `flags`) on the demo data's first rows, from the trainer's data setup."""
    args = parse_args([*TINY, "--cache_dir", str(tmp_path / "cache"), "--save_dir", "/runs/b",
                       *[part for name, value in flags.items() for part in (f"--{name}", str(value))]])
    return build_train_data(args, load_tokenizer(None), SimpleNamespace(world_size=1, rank=0, local_rank=0,
                                                                        device=torch.device("cpu"))).identity


def test_refusal_names_each_fixed_setting(tmp_path):
    rows = open(os.path.join(REPO, "dataset", "demo", "sft_train.jsonl"), encoding="utf-8").readlines()
    (tmp_path / "a.jsonl").write_text("".join(rows[:12]), encoding="utf-8")
    (tmp_path / "b.jsonl").write_text("".join(rows[12:20]), encoding="utf-8")
    identity = identity_of(tmp_path, data_path=tmp_path / "a.jsonl")
    for saved_stream in (run_identity.recorded(identity, None), {"fixed": identity.legacy_fixed()}):  # new and old records
        saved = {"sample_stream": saved_stream, "args": {"save_dir": "/runs/a", "data_path": str(tmp_path / "a.jsonl")}}
        unchanged = run_identity.refusal(saved, identity, "/runs/b")  # the old record's tokenizing code is version 1
        assert unchanged is None if "identity" in saved_stream else unchanged.startswith(
            "cannot resume: the tokenizing code (dataset.cache.key.TOKENS_VERSION) differs")
        for name, change in (("--max_seq_len", {"max_seq_len": 128}), ("--packing", {"packing": 1}),
                             ("--data_path content", {"data_path": tmp_path / "b.jsonl"}),
                             ("--data_path weights", {"data_path": f"{tmp_path / 'a.jsonl'}:2,{tmp_path / 'b.jsonl'}"})):
            problem = run_identity.refusal(saved, identity_of(tmp_path, **{"data_path": tmp_path / "a.jsonl", **change}),
                                           "/runs/b")
            assert problem.startswith(f"cannot resume: {name} differs from the checkpoint's run"), problem
            assert problem.endswith("--from_weight /runs/a/model --save_dir NEW_DIR")


# --------------------------------------------------------------------------- RNG


def test_each_rank_restores_its_own_devices_cuda_state_whatever_the_gpu_count():
    mine, other = torch.full((16,), 1, dtype=torch.uint8), torch.full((16,), 2, dtype=torch.uint8)
    cuda = torch.device("cuda", 1)
    assert cuda_state_for(mine, cuda) is mine  # this rank's device's state, saved alone
    assert cuda_state_for(mine, torch.device("cuda", 0)) is mine  # resumed on another GPU (count)
    # older checkpoints: every visible GPU's state; this device's entry where there is one
    assert cuda_state_for([other, mine], cuda) is mine
    assert cuda_state_for([mine], cuda) is None
    assert cuda_state_for(mine, torch.device("cpu")) is None and cuda_state_for(None, cuda) is None
    # on a CPU run a checkpoint's CUDA state is not an obstacle, nor a warning
    state = capture_rng_state(torch.device("cpu"))
    assert "cuda" not in state
    expected = torch.rand(3)
    torch.set_rng_state(state["torch"])
    assert restore_rng_state({**state, "cuda": [other, mine]}, torch.device("cpu")) is None
    assert torch.equal(torch.rand(3), expected)


def test_the_host_copy_of_a_gpu_state_holds_no_cuda_tensor():
    """The resume state a save writes (trainer/checkpoint/background.to_host), built from a model on
    a fake `cuda` device: every tensor in it is on the CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tests.helpers.tiny_model import tiny_model
    from trainer.checkpoint.background import to_host

    shapes = {key: (value.shape, value.dtype) for key, value in tiny_model().state_dict().items()}
    with FakeTensorMode(allow_non_fake_inputs=True):
        weights = {key: torch.empty(shape, dtype=dtype, device="cuda") for key, (shape, dtype) in shapes.items()}
        state = {"model": weights, "rng": [{"cuda": torch.zeros(16, dtype=torch.uint8, device="cuda")}],
                 "optimizer": {"state": {0: {"exp_avg": torch.zeros(3, device="cuda")}}, "param_groups": []}}
        assert state["model"]["model.embed_tokens.weight"].device.type == "cuda"
        copied = to_host(state)
    devices = set()

    def walk(tree):
        if isinstance(tree, torch.Tensor):
            devices.add(tree.device.type)
        elif isinstance(tree, dict):
            for value in tree.values():
                walk(value)
        elif isinstance(tree, (list, tuple)):
            for value in tree:
                walk(value)

    walk(copied)
    assert devices == {"cpu"}


# --------------------------------------------------------------------------- damaged or foreign files


def test_foreign_files_and_directories_are_named_for_what_they_are(tmp_path):
    (tmp_path / "random.pt").write_bytes(os.urandom(4096))
    (tmp_path / "notes.txt").write_text("not a checkpoint\n" * 100)
    for name in ("random.pt", "notes.txt"):
        with pytest.raises(CheckpointError) as caught:
            load_resume_checkpoint(str(tmp_path / name))
        assert str(caught.value) == (f"resume checkpoint {tmp_path / name} is corrupt or truncated (not a torch "
                                     "checkpoint: no complete zip archive in it)")
    torch.save({"tensor": torch.zeros(2), "rows": [1, 2]}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="is not a minisft resume checkpoint$"):
        load_resume_checkpoint(str(tmp_path / "plain.pt"))
    with pytest.raises(CheckpointError) as caught:
        load_resume_checkpoint(str(tmp_path))
    assert str(caught.value).startswith(f"resume checkpoint {tmp_path} is a directory: give a step_*.pt file")


def test_only_unreadable_checkpoints_stop_a_from_resume(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    assert find_resume_checkpoint(str(tmp_path), log=lambda _: None) is None
    for step in (1, 2):
        (folder / f"step_{step:08d}.pt").write_bytes(b"\0" * 1000)
    warnings = []
    with pytest.raises(CheckpointError) as caught:
        find_resume_checkpoint(str(tmp_path), log=warnings.append)
    assert len(warnings) == 2
    assert str(caught.value) == (
        f"none of the 2 resume checkpoint(s) in {folder} can be read (see the warnings above); to go on from the last "
        f"saved weights start a new run with --from_weight {tmp_path / 'model'} --save_dir NEW_DIR, or move the "
        "damaged checkpoints away")


@pytest.mark.slow
def test_damaged_checkpoints_or_a_fresh_run_never_replace_the_runs_model(data, tmp_path):
    save_dir = tmp_path / "run"
    run_trainer_in_process(flags(data, save_dir, "--batch_size", "8", "--max_steps", "2", "--save_interval", "1"),
                           check=True)
    weights = save_dir / "model" / "model.safetensors"
    before = hashlib.sha256(weights.read_bytes()).hexdigest()
    for name in os.listdir(save_dir / "checkpoints"):
        os.truncate(save_dir / "checkpoints" / name, 1000)
    damaged = run_trainer_in_process(flags(data, save_dir, "--batch_size", "8", "--max_steps", "3", "--from_resume", "1"))
    assert damaged.returncode == 2
    assert damaged.stderr.strip().splitlines()[-1].startswith(
        f"error: none of the 2 resume checkpoint(s) in {save_dir / 'checkpoints'} can be read")
    fresh = run_trainer_in_process(flags(data, save_dir, "--batch_size", "8", "--max_steps", "3", "--seed", "5"))
    assert fresh.returncode == 2
    assert fresh.stderr.strip().splitlines()[-1] == (
        f"error: --save_dir {save_dir} holds another run (checkpoints/ or model/): continue it with --from_resume 1, "
        f"choose another --save_dir, or pass --overwrite 1 to start over there (its files are moved to "
        f"{save_dir / 'set_aside'}/)")
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == before
    assert "Traceback" not in damaged.stderr + fresh.stderr


def test_overwrite_moves_the_previous_run_aside(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step_00000003.pt").write_bytes(b"old")
    (tmp_path / "model").mkdir()
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(CheckpointError, match="holds another run"):
        claim_for_fresh_run(str(tmp_path), overwrite=False)
    messages = []
    claim = claim_for_fresh_run(str(tmp_path), overwrite=True)
    assert os.path.isdir(tmp_path / "model")  # nothing moves before every check of the run has passed
    claim.carry_out(messages.append)
    [folder] = os.listdir(tmp_path / "set_aside")
    assert folder.endswith("-overwritten")
    moved = tmp_path / "set_aside" / folder
    assert (moved / "checkpoints" / "step_00000003.pt").read_bytes() == b"old"
    assert (moved / "model").is_dir() and (moved / "metrics.jsonl").is_file()
    assert sorted(os.listdir(tmp_path)) == ["set_aside"]
    assert messages == [f"--overwrite 1: moved the previous run's checkpoints, model, metrics.jsonl to {moved}"]
    claim_for_fresh_run(str(tmp_path), overwrite=False)  # now empty: accepted


def test_a_dir_holding_only_another_runs_best_or_metrics_is_claimed_like_one_with_checkpoints(tmp_path):
    """An empty checkpoints/ beside them holds nothing of a run: it is neither named nor moved."""
    for files in (("best", "metrics.jsonl"), ("metrics.jsonl",)):
        save_dir = tmp_path / "-".join(files)
        (save_dir / "checkpoints").mkdir(parents=True)
        for name in files:
            (save_dir / name).mkdir() if name == "best" else (save_dir / name).write_text('{"step": 1}\n')
        with pytest.raises(CheckpointError) as refused:
            claim_for_fresh_run(str(save_dir), overwrite=False)
        assert str(refused.value) == (
            f"--save_dir {save_dir} holds another run ({' and '.join(files)}): choose another --save_dir, or pass "
            f"--overwrite 1 to start over there (its files are moved to {save_dir / 'set_aside'}/)")
        # --from_resume 1 finds nothing to continue: the files are moved aside, named, and the run starts afresh
        messages = []
        claim_for_fresh_run(str(save_dir), overwrite=False, resuming=True).carry_out(messages.append)
        [folder] = os.listdir(save_dir / "set_aside")
        moved = save_dir / "set_aside" / folder
        assert folder.endswith("-no-checkpoint") and sorted(os.listdir(moved)) == sorted(files)
        assert messages == [f"--from_resume 1 found no checkpoint to continue: moved the previous run's "
                            f"{', '.join(files)} to {moved}"]
        assert sorted(os.listdir(save_dir)) == ["checkpoints", "set_aside"]


def test_a_save_dir_reached_through_a_symlink_into_a_runs_model_dir_is_seen(tmp_path):
    from trainer.checkpoint.save_dir import inside_a_run_model_dir

    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    (tmp_path / "link").symlink_to(run / "model")
    assert inside_a_run_model_dir(str(tmp_path / "link" / "nested")) == str(run / "model")
    assert inside_a_run_model_dir(str(tmp_path / "elsewhere")) is None


# --------------------------------------------------------------------------- rollback


@pytest.mark.slow
def test_a_rollback_keeps_the_new_line_and_sets_the_old_one_aside(data, tmp_path):
    common = ["--batch_size", "8", "--save_interval", "1", "--keep_last", "3"]
    run_trainer_in_process(flags(data, tmp_path, *common, "--max_steps", "6"), check=True)  # main() in this process
    old = {step: load_resume_checkpoint(checkpoint_at(tmp_path, step)) for step in (5, 6)}
    rollback = run_trainer_in_process(flags(data, tmp_path, *common, "--max_steps", "5", "--learning_rate", "1e-3",
                                            "--resume_from", checkpoint_at(tmp_path, 4)), check=True)
    [folder] = os.listdir(tmp_path / "set_aside")
    aside = tmp_path / "set_aside" / folder
    assert (f"resuming at step 4 while later checkpoints exist: moved step_00000005.pt, step_00000006.pt to {aside} "
            "(the new line of training replaces them") in rollback.stdout
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000004.pt", "step_00000005.pt"]
    new_line = load_resume_checkpoint(checkpoint_at(tmp_path, 5))["run_id"]
    assert new_line != old[5]["run_id"]
    for step in (5, 6):
        assert load_resume_checkpoint(str(aside / "checkpoints" / f"step_{step:08d}.pt"))["run_id"] == old[5]["run_id"]
    again = run_trainer_in_process(flags(data, tmp_path, *common, "--max_steps", "5", "--from_resume", "1"), check=True)
    assert f"resuming from {checkpoint_at(tmp_path, 5)} (step 5" in again.stdout
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl", encoding="utf-8")]
    assert [(row["step"], row["run_id"] == new_line) for row in rows if row["kind"] == "train"][-2:] == [
        (6, False), (5, True)]  # the old line up to 6, then the new line


# --------------------------------------------------------------------------- one run per save_dir


def test_a_save_dir_in_use_by_another_process_is_refused(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from trainer.checkpoint.save_dir import SaveDirLock; "
         f"lock = SaveDirLock({str(tmp_path)!r}).acquire(); print('locked', flush=True); sys.stdin.read()"],
        cwd=REPO, env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError) as caught:
            SaveDirLock(str(tmp_path)).acquire()
        assert str(caught.value) == (f"save_dir {tmp_path} in use by pid {holder.pid} (another training run writes "
                                     "there): wait for it to end, or choose another --save_dir")
    finally:
        holder.communicate("", timeout=30)
    SaveDirLock(str(tmp_path)).acquire().release()  # free again once the holder ended


@pytest.mark.slow
def test_a_second_trainer_on_a_locked_save_dir_stops_with_one_line(data, tmp_path):
    lock = SaveDirLock(str(tmp_path)).acquire()
    try:
        result = run_trainer(flags(data, tmp_path, "--max_steps", "1"), check=False)
    finally:
        lock.release()
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: save_dir {tmp_path} in use by pid {os.getpid()} (another training run writes there): wait for it "
        "to end, or choose another --save_dir")
    assert not os.path.exists(tmp_path / "metrics.jsonl")


# --------------------------------------------------------------------------- writing into a run's model/


def test_export_into_a_runs_model_dir_is_refused(tmp_path, capsys):
    from scripts.export_hf import main as export_main

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "model").mkdir()
    for out_dir in (run / "model", run / "model" / "hf"):
        with pytest.raises(SystemExit) as caught:
            export_main(["--model_path", str(tmp_path / "elsewhere.pt"), "--out_dir", str(out_dir)])
        assert caught.value.code == 2
        assert capsys.readouterr().err == (f"error: --out_dir {out_dir} is inside the training run's {run / 'model'}, "
                                           "which the run's next save replaces; choose a directory outside it\n")
    assert sorted(os.listdir(run / "model")) == []


def test_rank_zero_reads_the_resume_file_once_and_memory_maps_it(tmp_path, monkeypatch):
    import train_full_sft
    from trainer.checkpoint.single_file import FORMAT

    config = {"hidden_size": 32}
    state = {"format": FORMAT, "format_version": 1, "model_config": config, "model": {"w": torch.ones(3)},
             "optimizer": {}, "step": 3, "epoch": 0, "samples_in_epoch": 8, "rng": [], "world_size": 1, "args": {}}
    (tmp_path / "checkpoints").mkdir()
    torch.save(state, checkpoint_at(tmp_path, 3))
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k.get("mmap")) or real_load(*a, **k))
    args = SimpleNamespace(resume_from=None, from_resume=1, save_dir=str(tmp_path), overwrite=0, save_weight=None)
    ctx = SimpleNamespace(is_main=True, distributed=False)
    saved, _ = train_full_sft.locate_resume(args, SimpleNamespace(to_dict=lambda: config), ctx, lambda _: None)
    assert saved["step"] == 3 and torch.equal(saved["model"]["w"], torch.ones(3))
    assert loads == [True]


def test_the_save_dir_lock_dies_with_its_process_not_with_its_forked_workers(tmp_path):
    """A kill -9 of the trainer leaves its DataLoader workers alive for a moment: they must not keep the lock."""
    script = ("import os, time; from trainer.checkpoint.save_dir import SaveDirLock; "
              f"lock = SaveDirLock({str(tmp_path)!r}).acquire(); child = os.fork()\n"
              "if child == 0:\n    time.sleep(120); os._exit(0)\n"
              "print(child, flush=True); os._exit(0)")
    holder = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                              text=True)
    worker = int(holder.stdout.readline())
    holder.wait(timeout=60)  # the trainer is gone, its worker is not
    holder.stdout.close()
    try:
        os.kill(worker, 0)  # the forked worker still runs
        SaveDirLock(str(tmp_path)).acquire().release()
    finally:
        os.kill(worker, 9)
