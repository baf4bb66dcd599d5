"""Corrupt, foreign or malicious resume files: a one-line error, a fall-back past them, and no unsafe unpickling."""

import ast
import os

import pytest
import torch

from tests.helpers.fault_checks import ONE_PROCESS, last_line
from tests.helpers.malicious_pickle import malicious_checkpoint
from tests.helpers.trainer_launch import (REPO, assert_weights_equal, checkpoint_at, final_weights, flags,
                                         run_trainer_in_process)

pytestmark = pytest.mark.slow


def test_unusable_resume_files_give_a_one_line_error(data, reference, tmp_path):
    good = checkpoint_at(reference, 2)
    content = open(good, "rb").read()
    (tmp_path / "truncated.pt").write_bytes(content[: len(content) // 2])
    (tmp_path / "zeros.pt").write_bytes(bytes(len(content)))
    newer = torch.load(good, weights_only=True)
    newer["format_version"] = 2
    torch.save(newer, tmp_path / "newer.pt")
    marker = tmp_path / "code_ran"
    malicious_checkpoint(tmp_path / "malicious.pt", marker)
    cases = {
        "truncated": ([], f"error: resume checkpoint {tmp_path / 'truncated.pt'} is corrupt or truncated ("),
        "zeros": ([], f"error: resume checkpoint {tmp_path / 'zeros.pt'} is corrupt or truncated ("),
        "newer": ([], f"error: {tmp_path / 'newer.pt'} was written by a newer minisft (format version 2; this "
                      "version reads up to 1): upgrade minisft to resume from it"),
        "malicious": ([], f"error: refused to load {tmp_path / 'malicious.pt'}: it contains Python objects that a "
                          "safe (weights_only) load does not allow; it is not a minisft checkpoint and may be "
                          "malicious"),
        "other_config": (["--hidden_size", "64"], "error: checkpoint model config differs from the flags: "
                         "hidden_size (checkpoint 32, flags 64); head_dim (checkpoint 8, flags 16); "
                         "intermediate_size (checkpoint 128, flags 256)"),
    }
    for name, (extra, expected) in cases.items():  # each fails before training starts: no process of its own
        resume_file = good if name == "other_config" else tmp_path / f"{name}.pt"
        args = [*flags(data, tmp_path / f"run_{name}", "--max_steps", "12"), *extra, "--resume_from", str(resume_file)]
        result = run_trainer_in_process(args)
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        line = last_line(result.stderr)
        assert line.startswith(expected) if expected.endswith("(") else line == expected, (name, line)
        assert "Traceback" not in result.stderr and "training" not in result.stdout
    assert not marker.exists()


def test_from_resume_falls_back_past_unusable_latest_checkpoints(data, reference, tmp_path):
    save_dir = tmp_path / "run"
    os.makedirs(save_dir / "checkpoints")
    valid = checkpoint_at(reference, 6)
    content = open(valid, "rb").read()
    open(checkpoint_at(save_dir, 6), "wb").write(content)
    open(checkpoint_at(save_dir, 8), "wb").write(open(checkpoint_at(reference, 8), "rb").read()[:1000])
    open(checkpoint_at(save_dir, 9), "wb").write(bytes(len(content)))
    marker = tmp_path / "code_ran"
    malicious_checkpoint(checkpoint_at(save_dir, 10), marker)

    result = run_trainer_in_process(flags(data, save_dir, *ONE_PROCESS, "--from_resume", "1"), check=True)
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 3
    assert warnings[0] == (
        f"warning: skipping unusable checkpoint: refused to load {checkpoint_at(save_dir, 10)}: it contains Python "
        "objects that a safe (weights_only) load does not allow; it is not a minisft checkpoint and may be malicious; "
        "falling back to the previous one"
    )
    for line, step in zip(warnings[1:], (9, 8)):
        assert line.startswith(f"warning: skipping unusable checkpoint: resume checkpoint {checkpoint_at(save_dir, step)} "
                               "is corrupt or truncated (")
        assert line.endswith("; falling back to the previous one")
    assert f"resuming from {checkpoint_at(save_dir, 6)} (step 6" in result.stdout
    assert not marker.exists()
    assert_weights_equal(final_weights(save_dir), final_weights(reference))


def test_no_code_path_unpickles_untrusted_data():
    """Every torch.load passes weights_only=True; no np.load allows pickles; no pickle.load at all. The
    project's code reads sharded checkpoints only through trainer/checkpoint/dcp_reading.py: it names DCP's
    unpickling reader and planner nowhere else, and every dcp.load passes the safe ones."""
    dcp_reading = os.path.join("trainer", "checkpoint", "dcp_reading.py")
    problems = []
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and name not in ("out", "venv")]
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, REPO)
            project = relative.split(os.sep)[0] != "tests" and relative != dcp_reading
            tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
            for node in ast.walk(tree):
                named = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
                if project and named in ("FileSystemReader", "DefaultLoadPlanner"):
                    problems.append(f"{relative}:{node.lineno}: {named} (unpickles DCP's files unsafely)")
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
                keywords = {k.arg: k.value for k in node.keywords}
                where = f"{relative}:{node.lineno}"
                if owner == "torch" and node.func.attr == "load":
                    flag = keywords.get("weights_only")
                    if not (isinstance(flag, ast.Constant) and flag.value is True):
                        problems.append(f"{where}: torch.load without weights_only=True")
                if owner in ("np", "numpy") and node.func.attr == "load":
                    flag = keywords.get("allow_pickle")
                    if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False):
                        problems.append(f"{where}: np.load with allow_pickle")
                if owner == "pickle" and node.func.attr in ("load", "loads"):
                    problems.append(f"{where}: pickle.{node.func.attr}")
                if project and owner == "dcp" and node.func.attr == "load" and not {"storage_reader", "planner"} <= set(keywords):
                    problems.append(f"{where}: dcp.load without dcp_reading's storage_reader and planner")
    assert problems == []
