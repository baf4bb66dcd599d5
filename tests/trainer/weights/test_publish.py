"""model/ and best/ on disk (trainer/weights/write.py): the mode of the umask, a full disk leaves nothing behind."""

import json
import os
import resource
import shutil
import subprocess
import sys

import pytest

from tests.helpers.overfitted import script_in_process
from tests.helpers.tiny_weights import demo_slices
from tests.helpers.trainer_launch import REPO, SCRIPT, clean_env, run_trainer_in_process

data = pytest.fixture(scope="module", name="data")(demo_slices)


# hidden 16: bf16 weights of ~210 kB, less than the tokenizer.json (405 kB) written after them
SMALL = ["--hidden_size", "16", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--num_key_value_heads", "1",
         "--max_seq_len", "128", "--dtype", "float32", "--log_interval", "1", "--learning_rate", "3e-3",
         "--warmup_steps", "0", "--batch_size", "4", "--eval_interval", "1", "--keep_best", "eval_loss"]
UMASK = 0o007  # neither the usual 022 nor 077: 0o660 is what a file created by open() gets


def small_run(data, save_dir, *extra):
    return [*SMALL, "--data_path", str(data / "train.jsonl"), "--eval_data_path", str(data / "eight.jsonl"),
            "--save_dir", str(save_dir), *extra]


@pytest.fixture(scope="module")
def kept_best_run(data, tmp_path_factory):
    """Two steps, each evaluated (best/ written at each), model/ saved at step 2; under UMASK."""
    run = tmp_path_factory.mktemp("kept_best") / "run"
    previous = os.umask(UMASK)
    try:
        run_trainer_in_process(small_run(data, run, "--max_steps", "2", "--save_interval", "2"), check=True)
    finally:
        os.umask(previous)
    assert json.loads((run / "best" / "best.json").read_text())["step"] == 2
    return run


@pytest.mark.slow
def test_model_best_and_exported_files_get_the_mode_of_the_umask(kept_best_run, tmp_path):
    """safetensors creates its file 0600: another user could not read a model meant to be shared."""
    export = tmp_path / "export"
    previous = os.umask(UMASK)
    try:
        done = script_in_process("export_hf.py", "--model_path", str(kept_best_run), "--out_dir", str(export))
    finally:
        os.umask(previous)
    assert done.returncode == 0, done.stderr
    for folder in (kept_best_run / "model", kept_best_run / "best", export):
        modes = {path.name: oct(path.stat().st_mode & 0o777) for path in folder.iterdir()}
        assert "model.safetensors" in modes and modes == {name: oct(0o666 & ~UMASK) for name in modes}, folder


@pytest.mark.slow
@pytest.mark.parametrize("limit,failing", [(300_000, "tokenizer.json"), (100_000, "model.safetensors")])
def test_a_full_disk_while_publishing_best_is_one_line_and_leaves_nothing_behind(kept_best_run, data, tmp_path,
                                                                                 limit, failing):
    """The resumed run's first evaluation is a new best; writing best/ hits the file size limit, in the
    weights or (tokenizers raises a bare Exception) in the tokenizer."""
    run = tmp_path / "run"
    shutil.copytree(kept_best_run, run)
    sizes = {name: os.path.getsize(run / "best" / name) for name in ("model.safetensors", "tokenizer.json")}
    assert sizes[failing] > limit and (failing == "model.safetensors" or sizes["model.safetensors"] < limit)
    published = {path: path.read_bytes() for name in ("model", "best") for path in (run / name).iterdir()}

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run([sys.executable, SCRIPT, *small_run(data, run, "--max_steps", "4", "--save_interval", "2",
                                                                "--from_resume", "1")],
                            cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300,
                            preexec_fn=limit_file_size)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        f"error: could not write inference weights to {run / 'best'}: File too large"]
    assert [path for path in run.rglob("*") if ".tmp." in path.name] == []
    assert {path: path.read_bytes() for name in ("model", "best") for path in (run / name).iterdir()} == published


@pytest.mark.slow
def test_a_full_disk_during_an_export_is_one_line_and_leaves_nothing_behind(kept_best_run, tmp_path):
    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))  # the weights fit, tokenizer.json does not

    out_dir = tmp_path / "export"
    out_dir.mkdir()
    (out_dir / "previous.txt").write_text("an earlier export")
    for fmt in ("qwen3", "minimind"):
        done = subprocess.run([sys.executable, "scripts/export_hf.py", "--model_path", str(kept_best_run / "model"),
                               "--out_dir", str(out_dir), "--overwrite", "--format", fmt,
                               *(["--dtype", "bfloat16"] if fmt == "qwen3" else [])],
                              cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.splitlines()[-1] == {
            "qwen3": f"error: could not write the export to {out_dir}: File too large (nothing was changed there)",
            "minimind": f"error: could not write {out_dir / 'full_sft_16.pth'}: File too large"}[fmt]
        assert sorted(path.name for path in tmp_path.iterdir()) == ["export"]
        assert sorted(path.name for path in out_dir.iterdir()) == ["previous.txt"]
