"""The run's identity (trainer/run_identity.py): computed once from the data the run opened, kept in
every checkpoint, compared on resume; every shape of the record is read, an unreadable one is one line."""

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dataset import load_tokenizer
from dataset.cache import TOKENS_VERSION
from tests.helpers.trainer_launch import REPO, SCRIPT, TINY, clean_env, run_trainer_in_process
from trainer import run_identity
from trainer.args import parse_args
from trainer.checkpoint.resume import load_resume_checkpoint
from trainer.data_setup import build_train_data

DATA = Path(__file__).resolve().parent / "checkpoint" / "data"
DEMO = Path(REPO) / "dataset" / "demo" / "sft_train.jsonl"


def demo_rows(start: int, stop: int) -> str:
    return "".join(DEMO.read_text(encoding="utf-8").splitlines(keepends=True)[start:stop])


def identity(tmp_path, data_path: str, *extra: str) -> run_identity.RunIdentity:
    args = parse_args([*TINY, "--data_path", data_path, "--cache_dir", str(tmp_path / "cache"), *extra])
    ctx = SimpleNamespace(world_size=1, rank=0, local_rank=0, device=torch.device("cpu"))
    return build_train_data(args, load_tokenizer(None), ctx).identity


def refusal(tmp_path, before: run_identity.RunIdentity, now: run_identity.RunIdentity) -> str | None:
    saved = {"sample_stream": run_identity.recorded(before, None), "args": {"save_dir": str(tmp_path / "run"),
                                                                          "data_path": "DATA"}}
    return run_identity.refusal(saved, now, str(tmp_path / "run"))


def test_mixture_weights_are_compared_exactly_as_shares(tmp_path):
    (tmp_path / "a.jsonl").write_text(demo_rows(0, 6), encoding="utf-8")
    (tmp_path / "b.jsonl").write_text(demo_rows(6, 10), encoding="utf-8")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ones = identity(tmp_path, f"{a}:1,{b}:1")
    assert [source.share for source in ones.sources] == ["1/2", "1/2"]
    assert refusal(tmp_path, ones, identity(tmp_path, f"{a}:0.5,{b}:0.5")) is None  # the same stream
    problem = refusal(tmp_path, ones, identity(tmp_path, f"{a}:1,{b}:1.000004"))
    assert problem.startswith("cannot resume: --data_path weights differs from the checkpoint's run "
                              "(checkpoint 1,1, now 1,1.000004)"), problem


@pytest.mark.parametrize("kind", ["glob", "directory"])
def test_a_source_that_gains_a_file_is_refused_naming_the_file(tmp_path, kind):
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "part-0.jsonl").write_text(demo_rows(0, 6), encoding="utf-8")
    (shards / "part-1.jsonl").write_text(demo_rows(6, 12), encoding="utf-8")
    spec = str(shards / "*.jsonl") if kind == "glob" else str(shards)
    before = identity(tmp_path, spec)
    (shards / "part-2.jsonl").write_text(demo_rows(12, 18), encoding="utf-8")
    problem = refusal(tmp_path, before, identity(tmp_path, spec))
    assert problem.startswith(f"cannot resume: --data_path content differs from the checkpoint's run (checkpoint 2 "
                              f"file(s) in {spec}, now 3 file(s): new {shards / 'part-2.jsonl'})"), problem


def test_an_edited_file_and_another_sample_count_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(demo_rows(0, 8), encoding="utf-8")
    before = identity(tmp_path, str(path))
    path.write_text(demo_rows(1, 9), encoding="utf-8")
    problem = refusal(tmp_path, before, identity(tmp_path, str(path)))
    assert problem.startswith(f"cannot resume: --data_path content differs from the checkpoint's run (checkpoint "
                              f"{path} sha256 {before.sources[0].files[0].digest[:16]}, now sha256 "), problem
    fewer = run_identity.RunIdentity(before.seed, before.max_seq_len, before.packing, before.tokenizer, (
        run_identity.SourceRecord(before.sources[0].spec, 1.0, "1", (
            run_identity.SourceFile(str(path), before.sources[0].files[0].digest, 7, None),)),))
    assert f"(checkpoint {path} with 8 samples, now 7" in refusal(tmp_path, before, fewer)


def test_packing_with_a_system_prompt_ratio_is_another_sample_stream_and_says_where_prompts_fit(tmp_path, capsys):
    """--packing 1 plans rows with room for a system prompt when --system_prompt_ratio is above 0: a resume
    that switches it is refused; without packing the ratio changes no sample's place."""
    path = tmp_path / "a.jsonl"
    path.write_text(demo_rows(0, 8), encoding="utf-8")
    packed = identity(tmp_path, str(path), "--packing", "1", "--system_prompt_ratio", "0.2")
    assert "[data] --system_prompt_ratio 0.2: 1 of 1 samples without a system prompt have room for one within " \
           "--max_seq_len 512, 0 only for the shorter prompts, 0 for none; 20.0% of them get one\n" in capsys.readouterr().out
    assert refusal(tmp_path, identity(tmp_path, str(path), "--packing", "1"), packed) == (
        "cannot resume: --system_prompt_ratio (with --packing 1 it sets room for a system prompt in the rows) differs "
        "from the checkpoint's run (checkpoint 0, now above 0), so its position in the epoch would mean other samples; "
        f"resume with --system_prompt_ratio 0, or start a new run from its weights with --from_weight {tmp_path}/run/model "
        "--save_dir NEW_DIR")
    assert refusal(tmp_path, identity(tmp_path, str(path)), identity(tmp_path, str(path), "--system_prompt_ratio", "0.2")) is None


def test_a_resume_across_a_change_of_the_tokenizing_code_is_refused(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(demo_rows(0, 8), encoding="utf-8")
    now = identity(tmp_path, str(path))
    before = dataclasses.replace(now, tokens_version=now.tokens_version - 1)
    assert refusal(tmp_path, before, now).startswith(
        "cannot resume: the tokenizing code (dataset.cache.key.TOKENS_VERSION) differs from the checkpoint's run "
        f"(checkpoint {now.tokens_version - 1}, now {now.tokens_version})")


def start_and_stop(argv: list[str], while_training) -> str:
    """Run the trainer, call `while_training()` once it logged step 2, then SIGTERM it; its output.
    The stop's resume checkpoint is written after `while_training` changed the data."""
    job = subprocess.Popen([sys.executable, SCRIPT, *argv], cwd=REPO, env=clean_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in job.stdout:
        lines.append(line)
        if line.startswith("step 2/"):
            break
    while_training()
    job.send_signal(signal.SIGTERM)
    output = "".join(lines) + job.communicate(timeout=300)[0]
    assert job.returncode == 0, output
    assert "continue with --from_resume 1" in output, output
    return output


@pytest.mark.slow
def test_a_glob_grown_during_the_run_is_refused_on_resume_naming_the_new_file(tmp_path):
    """The checkpoint holds the files the run opened, not what the glob matches at save time."""
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "part-0.jsonl").write_text(demo_rows(0, 14), encoding="utf-8")
    (shards / "part-1.jsonl").write_text(demo_rows(14, 28), encoding="utf-8")
    save_dir = tmp_path / "run"
    argv = [*TINY, "--data_path", str(shards / "*.jsonl"), "--save_dir", str(save_dir), "--batch_size", "1",
            "--epochs", "5", "--cache_dir", str(tmp_path / "cache")]
    start_and_stop(argv, lambda: (shards / "part-2.jsonl").write_text(demo_rows(28, 40), encoding="utf-8"))
    saved = load_resume_checkpoint(os.path.join(save_dir, "checkpoints", sorted(os.listdir(save_dir / "checkpoints"))[-1]))
    recorded = run_identity.RunIdentity.from_dict(saved["sample_stream"]["identity"])
    assert [Path(file.path).name for file in recorded.sources[0].files] == ["part-0.jsonl", "part-1.jsonl"]
    result = run_trainer_in_process([*argv, "--from_resume", "1"])
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: cannot resume: --data_path content differs from the checkpoint's run (checkpoint "
                           f"2 file(s) in {shards / '*.jsonl'}, now 3 file(s): new {shards / 'part-2.jsonl'})"), line


@pytest.mark.slow
def test_a_data_file_moved_after_start_still_gets_its_sigterm_checkpoint(tmp_path):
    """Training reads only the token cache; the SIGTERM save does not touch the data files."""
    data = tmp_path / "train.jsonl"
    data.write_text(demo_rows(0, 80), encoding="utf-8")
    save_dir = tmp_path / "run"
    argv = [*TINY, "--data_path", str(data), "--save_dir", str(save_dir), "--batch_size", "1", "--epochs", "3",
            "--cache_dir", str(tmp_path / "cache")]
    start_and_stop(argv, lambda: shutil.move(data, tmp_path / "moved.jsonl"))
    assert os.listdir(save_dir / "checkpoints")


def test_a_version_1_stream_record_is_refused_naming_the_tokenizing_code(tmp_path):
    """tests/trainer/checkpoint/data/main_af11f2e_step_00000002.pt holds a version 1 sample-stream record, without
    the tokenizing code's version: its tokenizing code is version 1, and a resume by
    code of another version (whose sample stream may differ: think blocks, rows that are bad by its rules) is refused in one line."""
    data = tmp_path / "train.jsonl"
    shutil.copy(DATA / "main_af11f2e_train.jsonl", data)
    saved = torch.load(DATA / "main_af11f2e_step_00000002.pt", weights_only=True)
    now = identity(tmp_path, str(data), "--batch_size", "4")
    assert run_identity.refusal(saved, now, str(tmp_path / "resumed")) == (
        "cannot resume: the tokenizing code (dataset.cache.key.TOKENS_VERSION) differs from the checkpoint's run "
        f"(checkpoint 1, now {TOKENS_VERSION}), so its position in the epoch would mean other samples; resume with "
        "the minisft version that wrote the checkpoint, or start a new run from its weights with --from_weight "
        "/tmp/af11run/out/model --save_dir NEW_DIR")


def test_every_shape_of_the_record_is_read_and_an_unreadable_one_is_one_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(demo_rows(0, 8), encoding="utf-8")
    now = identity(tmp_path, str(path))
    current = run_identity.recorded(now, None)
    assert current["version"] == 6 and run_identity.refusal({"sample_stream": current, "args": {}}, now, "/r") is None
    # version 2 as written before tokens_version was recorded (and before left_out): tokenizing code 1
    old = {**current["identity"], "sources": [{k: v for k, v in source.items() if k != "left_out"}
                                              for source in current["identity"]["sources"]]}
    del old["tokens_version"]
    stream = {"version": 2, "identity": old, "epoch_grouping": None}
    assert run_identity.refusal({"sample_stream": stream, "args": {}}, now, "/r").startswith(
        "cannot resume: the tokenizing code (dataset.cache.key.TOKENS_VERSION) differs from the checkpoint's run "
        f"(checkpoint 1, now {TOKENS_VERSION})")
    # version 2 with tokens_version and left_out: read as such
    stream = {**current, "version": 2}
    assert run_identity.refusal({"sample_stream": stream, "args": {}}, now, "/r") is None
    # version 3, without prompt_room: rows without room for a system prompt
    stream = {**current, "version": 3, "identity": {k: v for k, v in current["identity"].items() if k != "prompt_room"}}
    assert run_identity.refusal({"sample_stream": stream, "args": {}}, now, "/r") is None
    # version 4, files without samples_digest: compared by their number of samples (8, as in this run)
    files = [{k: v for k, v in file.items() if k != "samples_digest"} for file in current["identity"]["sources"][0]["files"]]
    stream = {**current, "version": 4, "identity": {**current["identity"], "sources": [
        {**current["identity"]["sources"][0], "files": files}]}}
    assert run_identity.refusal({"sample_stream": stream, "args": {}}, now, "/r") is None
    # version 5, without room_rule: a run without room for a system prompt resumes; one with it planned its
    # rows' room by rule 1, which took a system text after a newline for none (dataset.augment.ROOM_RULE)
    stream = {**current, "version": 5, "identity": {k: v for k, v in current["identity"].items() if k != "room_rule"}}
    assert run_identity.refusal({"sample_stream": stream, "args": {}}, now, "/r") is None
    roomy = dataclasses.replace(now, prompt_room=True)
    stream = {**stream, "identity": {**stream["identity"], "prompt_room": True}}
    assert run_identity.refusal({"sample_stream": stream, "args": {}}, roomy, "/r") == (
        "cannot resume: the rule that finds a sample's own system prompt (dataset.augment.ROOM_RULE: --packing 1 plans "
        "the rows' room for a system prompt by it) differs from the checkpoint's run (checkpoint 1, now 2), so its "
        "position in the epoch would mean other samples; resume with the minisft version that wrote the checkpoint, "
        "or start a new run from its weights with --from_weight /r/model --save_dir NEW_DIR")
    assert run_identity.refusal({"sample_stream": run_identity.recorded(roomy, None), "args": {}}, roomy, "/r") is None
    # version 6 lacking a field, and a newer version: one line each, no KeyError
    broken = {**current, "identity": {k: v for k, v in current["identity"].items() if k != "prompt_room"}}
    for stream, reason in ((broken, "no 'prompt_room'"), ({**current, "version": 7},
                                                          "version 7; this minisft reads up to 6")):
        assert run_identity.refusal({"sample_stream": stream, "args": {}}, now, "/r") == (
            f"cannot resume: the checkpoint's record of its sample stream (version {stream['version']}) cannot be "
            f"read ({reason}); resume with the minisft version that wrote the checkpoint, or start a new run from its "
            "weights with --from_weight /r/model --save_dir NEW_DIR")




@pytest.mark.slow
def test_a_moved_byte_identical_data_file_resumes_and_a_changed_one_is_refused(tmp_path):
    """Data is compared by content: the same bytes at another path resume bit-identically."""
    from tests.helpers.trainer_launch import assert_weights_equal, final_weights

    first = tmp_path / "a.jsonl"
    first.write_text(demo_rows(0, 40), encoding="utf-8")
    common = [*TINY, "--batch_size", "2", "--save_interval", "2", "--cache_dir", str(tmp_path / "cache")]
    # one-process runs, all in this process (train_full_sft.main, one torch thread): compared bit for bit
    run_trainer_in_process([*common, "--data_path", str(first), "--save_dir", str(tmp_path / "whole"), "--max_steps",
                            "4"], check=True)
    run_trainer_in_process([*common, "--data_path", str(first), "--save_dir", str(tmp_path / "run"), "--max_steps",
                            "2"], check=True)
    moved = tmp_path / "elsewhere" / "b.jsonl"
    moved.parent.mkdir()
    shutil.move(first, moved)
    resumed = run_trainer_in_process([*common, "--data_path", str(moved), "--save_dir", str(tmp_path / "run"),
                                      "--max_steps", "4", "--from_resume", "1"], check=True)
    assert "training 4 optimizer steps from step 2" in resumed.stdout
    assert_weights_equal(final_weights(str(tmp_path / "run")), final_weights(str(tmp_path / "whole")))
    moved.write_text(demo_rows(1, 41), encoding="utf-8")
    changed = run_trainer_in_process([*common, "--data_path", str(moved), "--save_dir", str(tmp_path / "run"),
                                      "--max_steps", "6", "--resume_from",
                                      str(tmp_path / "run" / "checkpoints" / "step_00000002.pt")])
    assert changed.returncode == 2, changed.stderr
    digest = run_identity.RunIdentity.from_dict(load_resume_checkpoint(str(
        tmp_path / "run" / "checkpoints" / "step_00000002.pt"))["sample_stream"]["identity"]).sources[0].files[0].digest
    assert changed.stderr.strip().splitlines()[-1].startswith(
        f"error: cannot resume: --data_path content differs from the checkpoint's run (checkpoint {first} sha256 "
        f"{digest[:16]}, now {moved} sha256 ")
