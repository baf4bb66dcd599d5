"""scripts/verify_equivalence.py: the trainer's equivalences checked by real runs (CPU, gloo, TINY
model, 96 demo rows), a planted normalisation bug caught, user errors in one line."""

import math
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from scripts import verify_equivalence
from scripts.verify_equivalence import compare, drop_flags, main, variants
from tests.helpers.in_process import run_in_process
from tests.helpers.trainer_launch import FAULTY_TRAINER, REPO, SCRIPT, TINY, clean_env, finish, free_port

TOOL = os.path.join(REPO, "scripts", "verify_equivalence.py")
HEADER = ["variant", "against", "max |diff|", "rel diff", "tolerance", "result", "worst tensor (its rel diff)"]
TWO = ["1 process x batch 4 (reference)", "1 process x batch 2 x accumulation 2", "2 processes x batch 2",
       "2 processes x batch 2, resumed at step 4"]
ONE = ["1 process x batch 4 (reference)", "1 process x batch 2 x accumulation 2",
       "1 process x batch 4, resumed at step 4"]
# The one-process variants trained from step 0: tests on the check's table and lines run them in the
# test process (the check's own start of those processes is exercised by the two-node test and by
# the resumed one-process variant of the accumulation test).
SINGLE = ("reference", "accum")


def run_tool(*args: str, env=None, launcher=None, timeout: float = 600, tool=(TOOL,)) -> subprocess.CompletedProcess:
    return subprocess.run([*(launcher or [sys.executable]), *tool, *args], cwd=REPO, env=env or clean_env(),
                          capture_output=True, text=True, timeout=timeout)


class TrainerInProcess:
    """A finished one-process trainer run standing in for the `subprocess.Popen` of
    `[python, train_full_sft.py, *flags]` that the check starts: the trainer's main() on the check's own flags,
    in this process under the environment the check gave it; stdout and stderr together, as piped.
    For `[python, FAULTY_TRAINER, *flags]`, the faults of that environment are installed for the run
    (tests/helpers/faults.py) and trainer/loop/loop.py's functions put back after it."""

    def __init__(self, command, env, **_):
        import train_full_sft
        from tests.helpers import faults
        from trainer.loop import loop

        def call():
            os.environ.clear()
            os.environ.update(env)
            if command[1] != FAULTY_TRAINER:
                return train_full_sft.main(command[2:])
            real = {name: getattr(loop, name) for name in faults.WRAPPED}
            try:
                faults.install()
                return train_full_sft.main(command[2:])
            finally:
                for name, function in real.items():
                    setattr(loop, name, function)

        done = run_in_process(command, call, threads=1)  # one torch thread, as OMP_NUM_THREADS=1 gives a process
        self.returncode, self.output = done.returncode, done.stdout + done.stderr

    def communicate(self, timeout=None):
        return self.output, None


def popen_with_runs_in_process(kinds: tuple[str, ...]):
    """`subprocess` as the check sees it: its one-process runs of the variants `kinds` (the names of
    their save directories) run in this process; every other command starts its process."""
    def popen(command, **kwargs):
        save_dir = command[command.index("--save_dir") + 1] if "--save_dir" in command else ""
        if command[:2] in ([sys.executable, SCRIPT], [sys.executable, FAULTY_TRAINER]) and \
                os.path.basename(save_dir) in kinds:
            return TrainerInProcess(command, **kwargs)
        return subprocess.Popen(command, **kwargs)

    return types.SimpleNamespace(Popen=popen, PIPE=subprocess.PIPE, STDOUT=subprocess.STDOUT,
                                 TimeoutExpired=subprocess.TimeoutExpired)


def run_tool_in_process(*args: str, trainer: str | None = None, in_process: tuple[str, ...] = (),
                        **env) -> subprocess.CompletedProcess:
    """The check's main() in this process, with `run_tool`'s environment (that its trainer processes
    inherit): for runs whose result is the table or a line of main()'s, not a property of the check's
    own process. `trainer`: the script its trainer runs start (FAULTY_TRAINER: faults planted).
    `in_process`: the variants (reference, accum) whose one-process trainer runs go in this process
    too, with the flags and environment the check gives them; a resumed run stays a fresh process."""
    def call():
        os.environ.clear()
        os.environ.update(clean_env(**env))
        return main(list(args))

    real = verify_equivalence.TRAINER
    verify_equivalence.TRAINER = trainer or real
    if in_process:
        verify_equivalence.subprocess = popen_with_runs_in_process(in_process)
    try:
        return run_in_process(["verify_equivalence.py", *args], call, cwd=REPO)
    finally:
        verify_equivalence.TRAINER, verify_equivalence.subprocess = real, subprocess


def tool_flags(data, work_dir, *extra) -> list[str]:
    return ["--work_dir", str(work_dir), *TINY, "--data_path", str(data / "train.jsonl"), "--batch_size", "2", *extra]


def table(stdout: str) -> dict[str, dict[str, str]]:
    """The printed table: {variant: {column: cell}}, in order."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("variant "))
    assert re.split(r"\s{2,}", lines[start].strip()) == HEADER
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("verdict:"):
            break
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == len(HEADER), line
        rows[cells[0]] = dict(zip(HEADER, cells))
    return rows


def verdict(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("verdict:"))


def assert_all_within_tolerance(rows: dict, names: list[str]) -> None:
    assert list(rows) == names
    for name in names[1:]:
        row = rows[name]
        assert row["result"] == "OK", row
        assert float(row["rel diff"]) <= float(row["tolerance"]) == 1e-3, row


# --------------------------------------------------------------------------- whole runs


@pytest.mark.slow
def test_two_processes_one_process_accumulation_and_resume_agree(data, tmp_path):
    done = run_tool_in_process("--nproc_per_node", "2", *tool_flags(data, tmp_path), in_process=SINGLE)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = table(done.stdout)
    assert_all_within_tolerance(rows, TWO)
    assert rows[TWO[3]]["against"] == TWO[2]  # a resumed run against its own uninterrupted run
    assert rows[TWO[3]]["max |diff|"] == "0" and rows[TWO[3]]["worst tensor (its rel diff)"] == "-"  # bit-identical
    assert verdict(done.stdout) == "verdict: OK: all 3 variants agree within 1e-03 (float32)"
    assert "dtype float32, device cpu" in done.stdout
    assert os.listdir(tmp_path) == []  # the runs' directories are removed after an OK


@pytest.mark.slow
def test_one_process_compares_accumulation_2_with_batch_2b(data, tmp_path):
    # a copied training command: the flags the check sets itself are named and not used
    done = run_tool_in_process("--nproc_per_node", "1", *tool_flags(data, tmp_path / "work"), "--save_dir",
                               str(tmp_path / "out"), "--save_interval", "100", "--eval_data_path", str(data / "eval.jsonl"),
                               in_process=SINGLE)  # the resumed run is a fresh process: its bit-identity is one
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == "note: the check sets --eval_data_path, --save_dir, --save_interval itself: " \
                                          "your value is not used"
    assert not (tmp_path / "out").exists()
    rows = table(done.stdout)
    assert_all_within_tolerance(rows, ONE)
    assert rows[ONE[2]]["against"] == "reference" and rows[ONE[2]]["max |diff|"] == "0"
    assert verdict(done.stdout) == ("verdict: OK: all 2 variants agree within 1e-03 (float32); not checked: several "
                                    "processes (one process here; --nproc_per_node 2 runs two, with gloo on a CPU)")


@pytest.mark.slow
def test_a_planted_per_rank_mean_fails_the_two_process_variant(data, tmp_path):
    """MINISFT_FAULT_LOCAL_MEAN=1 (tests/helpers/faults.py): every rank divides by its own loss-token
    count, the classic bug. One process is unaffected, so only the 2-process row fails."""
    done = run_tool_in_process("--nproc_per_node", "2", *tool_flags(data, tmp_path), trainer=FAULTY_TRAINER,
                               in_process=SINGLE, MINISFT_FAULT_LOCAL_MEAN="1")
    assert done.returncode == 1, done.stdout + done.stderr
    rows = table(done.stdout)
    assert list(rows) == TWO
    bad = rows["2 processes x batch 2"]
    assert bad["result"] == "FAIL" and float(bad["rel diff"]) > 10 * float(bad["tolerance"]), bad
    assert rows["1 process x batch 2 x accumulation 2"]["result"] == "OK"
    assert rows[TWO[3]]["result"] == "OK"  # the resume of the buggy run is still exact
    assert verdict(done.stdout).startswith("verdict: FAIL: 2 processes x batch 2 differs by ")
    assert "across processes" in verdict(done.stdout)
    assert len(os.listdir(tmp_path)) == 1  # kept for a look after a FAIL, and named
    assert f"the runs' directories and logs: {tmp_path / os.listdir(tmp_path)[0]}" in done.stdout


@pytest.mark.slow
def test_started_by_torchrun_on_two_nodes_it_trains_in_that_world(data, tmp_path):
    """Two torchrun agents as two nodes (static rendezvous on 127.0.0.1, one process each): the
    2-process variants run on those two ranks, the one-process ones on rank 0."""
    port, procs = free_port(), []
    for node in (0, 1):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                    "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port)]
        procs.append(subprocess.Popen([*launcher, TOOL, *tool_flags(data, tmp_path)], cwd=REPO, env=clean_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [node.stdout for node in finish(procs, timeout=600)]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert_all_within_tolerance(table(outputs[0]), TWO)
    assert "verdict:" not in outputs[1]  # rank 1 only trains


# --------------------------------------------------------------------------- user errors


@pytest.mark.parametrize("args, message", [
    (["--batch_size", "0"], "error: --batch_size must be >= 1 (got 0) (a trainer flag: see python train_full_sft.py --help)"),
    (["--no_such_flag", "1"], "error: unrecognized arguments: --no_such_flag 1 (a trainer flag: see python train_full_sft.py --help)"),
    (["--dropout", "0.1"], "error: --dropout 0.1: dropout masks differ between process layouts, so the runs cannot "
                           "agree; check with --dropout 0"),
    (["--resume_step", "8"], "error: --resume_step must be between 1 and --max_steps - 1 = 7 (got 8)"),
    (["--nproc_per_node", "two"], "error: --nproc_per_node must be auto or a number >= 1 (got 'two')"),
    (["--timeout", "0"], "error: --timeout must be a positive number (got 0.0)"),
    (["--world_size", "2"], "error: --world_size: give the processes with --nproc_per_node, or start this script "
                            "with torchrun"),
])
def test_a_bad_flag_is_one_line_and_exit_2(tmp_path, args, message):
    done = run_tool("--work_dir", str(tmp_path), *TINY, *args)
    assert done.returncode == 2
    assert done.stderr.strip() == message
    assert os.listdir(tmp_path) == []  # refused before anything ran


def test_several_processes_without_torchrun_are_refused(tmp_path):
    done = run_tool("--work_dir", str(tmp_path), *TINY, env=clean_env(SLURM_PROCID="0", SLURM_NTASKS="2"))
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: several processes need torchrun's store: start this script with torchrun "
                                   "(one per node; not with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), or with plain "
                                   "python and --nproc_per_node N")


def test_missing_data_is_the_trainers_one_line_error_and_exit_2(tmp_path):
    done = run_tool_in_process("--work_dir", str(tmp_path), *TINY, "--data_path", str(tmp_path / "nope.jsonl"))
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and "nope.jsonl" in line


# --------------------------------------------------------------------------- pieces


def test_the_check_drops_the_flags_it_sets_itself_with_their_values():
    argv = ["--save_dir", "out", "--hidden_size", "64", "--use_wandb", "--eval_data_path=e.jsonl", "--keep_last",
            "2", "--total_steps", "100", "--packing", "1"]
    assert drop_flags(argv, ("save_dir", "use_wandb", "eval_data_path", "keep_last", "max_steps")) == (
        ["--hidden_size", "64", "--packing", "1"],
        ["--save_dir", "--use_wandb", "--eval_data_path", "--keep_last", "--total_steps"])


def test_variants_keep_the_global_batch():
    for nproc, names in ((2, TWO), (1, ONE)):
        found = variants(nproc, 2, 1, 4)
        assert [v.name for v in found] == names
        assert {v.nproc * v.batch * v.accum for v in found} == {4}
    eight = variants(8, 1, 2, 3)
    assert [v.name for v in eight] == ["1 process x batch 8 x accumulation 2 (reference)",
                                       "1 process x batch 1 x accumulation 16", "8 processes x batch 1 x accumulation 2",
                                       "8 processes x batch 1 x accumulation 2, resumed at step 3"]


def test_the_relative_difference_is_measured_against_the_reference_s_own_update():
    earlier = {"a": torch.zeros(4), "b": torch.ones(2)}
    reference = {"a": torch.full((4,), 0.5), "b": torch.ones(2)}  # the update: |a| moved by 1.0, b did not move
    assert compare(reference, earlier, {k: v.clone() for k, v in reference.items()}) == (0.0, 0.0, "-")
    off = {"a": reference["a"] + torch.tensor([0.01, 0, 0, 0]), "b": torch.ones(2)}
    max_abs, rel, worst = compare(reference, earlier, off)
    assert max_abs == pytest.approx(0.01) and rel == pytest.approx(0.01) and worst == "a (0.01)"
    moved_b = {"a": reference["a"], "b": torch.tensor([1.0, 1.5])}  # moved where the reference did not
    assert compare(reference, earlier, moved_b) == (0.5, 0.5, "b (inf)")
    assert compare(reference, earlier, {"a": reference["a"]})[:2] == (math.inf, math.inf)
    assert compare(reference, earlier, {"a": reference["a"], "b": torch.tensor([1.0, math.nan])})[1] == math.inf


def test_too_little_data_for_the_resume_step_is_a_user_error(data, tmp_path):
    few = tmp_path / "few.jsonl"
    few.write_text("".join(open(data / "train.jsonl", encoding="utf-8").readlines()[:5]), encoding="utf-8")
    done = run_tool_in_process("--nproc_per_node", "1", "--work_dir", str(tmp_path), *TINY, "--data_path", str(few),
                               "--batch_size", "2", in_process=SINGLE)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == ("error: 1 process x batch 4 (reference) ended before step 4 (too little data for "
                                   "this global batch): lower --resume_step, --max_steps or --batch_size")
    assert f"running {ONE[1]}" not in done.stdout  # said right after the run that ended early, none run in between
