"""trainer/checkpoint/save_dir.py: the folders a run writes are checked before anything in --save_dir moves."""

from tests.helpers.trainer_launch import flags, run_trainer_in_process


def test_a_cache_dir_that_cannot_be_written_fails_before_the_previous_run_is_set_aside(data, tmp_path):
    # --overwrite 1 sets the previous run aside before the data is read: a --cache_dir that cannot be a folder is
    # found before that, and named by its flag.
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002.pt").write_bytes(b"a previous run's checkpoint")
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 2}\n')
    (tmp_path / "a_file").write_text("not a directory")
    done = run_trainer_in_process(flags(data, run, "--overwrite", "1", "--cache_dir", str(tmp_path / "a_file")))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"error: --cache_dir {tmp_path / 'a_file'} cannot be a folder: "
                                        f"{tmp_path / 'a_file'} is a file"]
    assert sorted(path.name for path in run.iterdir()) == ["checkpoints", "metrics.jsonl"]
    assert (run / "checkpoints" / "step_00000002.pt").read_bytes() == b"a previous run's checkpoint"


def test_a_save_dir_whose_model_folder_holds_python_source_is_refused_even_with_overwrite(data, tmp_path):
    """`--save_dir . --overwrite 1` in the repository would move the `model/` package aside and
    write weights in its place: every later command would fail to import the model."""
    repo = tmp_path / "checkout"
    (repo / "model").mkdir(parents=True)
    (repo / "model" / "loss.py").write_text("IGNORE_INDEX = -100\n")
    done = run_trainer_in_process(flags(data, repo, "--overwrite", "1"))
    assert (done.returncode, done.stderr.splitlines()) == (2, [
        f"error: --save_dir {repo}: its model/ holds Python source (minisft's own package?), not a run's weights, "
        "and is never moved: choose another --save_dir"])
    assert sorted(str(path.relative_to(repo)) for path in repo.rglob("*")) == [".lock", "model", "model/loss.py"]
