"""A full or unwritable disk: one line, before training or at the failed save, and the previous checkpoint kept."""

import shutil

import pytest
from safetensors.torch import load_file

from tests.helpers.fault_checks import ONE_PROCESS, all_finite, checkpoint_names, digest, last_line
from tests.helpers.faults import FILE_LIMIT_ENV
from tests.helpers.trainer_launch import (
    FAULTY_TRAINER, checkpoint_at, clean_env, flags, run_trainer_in_process, run_trainer_with_a_read_only,
)
from trainer.checkpoint.resume import load_resume_checkpoint

pytestmark = pytest.mark.slow


def test_an_unwritable_save_dir_fails_before_training(data, tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    for save_dir in (tmp_path / "a_file" / "run", tmp_path / "a_file"):
        result = run_trainer_in_process(flags(data, save_dir, "--max_steps", "2"))
        assert result.returncode == 2
        assert last_line(result.stderr) == f"error: --save_dir {save_dir} cannot be a folder: {tmp_path / 'a_file'} is a file"
        assert "Traceback" not in result.stderr and "training" not in result.stdout
    assert (tmp_path / "a_file").read_text() == "not a directory"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a read-only bind mount")
@pytest.mark.parametrize("folder", ["checkpoints", "model"])
def test_a_read_only_folder_of_the_save_dir_fails_before_training(data, tmp_path, folder):
    save_dir = tmp_path / "run"
    run_trainer_in_process(flags(data, save_dir, "--max_steps", "2"), check=True)  # the run the refused one resumes
    mounted = save_dir / folder
    before = {path.name: digest(path) for path in mounted.iterdir()}
    result = run_trainer_with_a_read_only(mounted, flags(data, save_dir, "--max_steps", "4", "--from_resume", "1"))
    assert result.returncode == 2, result.stderr
    assert last_line(result.stderr) == f"error: --save_dir {save_dir} is not writable: {mounted}: Read-only file system"
    assert "Traceback" not in result.stderr and "resuming" not in result.stdout
    assert {path.name: digest(path) for path in mounted.iterdir()} == before


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a read-only bind mount")
def test_a_model_folder_that_links_to_a_read_only_one_is_replaced_by_the_save_not_refused(data, tmp_path):
    # a save renames a new model/ over the link; the read-only folder it points to is never written
    save_dir, published = tmp_path / "run", tmp_path / "published"
    run_trainer_in_process(flags(data, save_dir, "--max_steps", "2"), check=True)
    (save_dir / "model").rename(published)
    (save_dir / "model").symlink_to(published)
    before = {path.name: digest(path) for path in published.iterdir()}
    result = run_trainer_with_a_read_only(published, flags(data, save_dir, "--max_steps", "4", "--from_resume", "1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (save_dir / "model").is_symlink() and (save_dir / "model" / "model.safetensors").is_file()
    assert {path.name: digest(path) for path in published.iterdir()} == before


def test_a_full_disk_fails_the_save_cleanly_and_keeps_the_previous_checkpoint(data, launcher, tmp_path):
    save_dir = tmp_path / "run"
    # from the second save on (step 4), once the first is written, no file may grow past 256 KiB: well
    # above metrics.jsonl and the logs, well below a 2.8 MB checkpoint
    env = clean_env(**{FILE_LIMIT_ENV: f"4:{256 * 1024}"})
    process = launcher.start(flags(data, save_dir, *ONE_PROCESS), "disk_full", env=env, script=FAULTY_TRAINER)
    assert launcher.wait(process) == 2, launcher.output(process)
    first = checkpoint_at(save_dir, 2)
    out, err = launcher.output(process)
    assert last_line(err) == f"error: could not write {checkpoint_at(save_dir, 4)}: File too large"
    assert "Traceback" not in err
    assert checkpoint_names(save_dir) == ["step_00000002.pt"]  # no .tmp leftovers
    assert load_resume_checkpoint(first)["step"] == 2  # complete: it loads
    assert all_finite(load_file(save_dir / "model" / "model.safetensors"))
