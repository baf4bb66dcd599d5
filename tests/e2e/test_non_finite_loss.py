"""Non-finite losses: a bad step is skipped, too many in a row stop the run with the last good weights saved.
A step out of GPU memory stops the run in one line that says which flags set the memory, checkpoints kept."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.fault_checks import all_finite, last_line
from tests.helpers.faults import run_in_this_process
from tests.helpers.trainer_launch import FAULTY_TRAINER, assert_weights_equal, checkpoint_at, flags, run_ranks_apart
from trainer.checkpoint.resume import load_resume_checkpoint

pytestmark = pytest.mark.slow


def test_non_finite_steps_are_skipped_and_too_many_in_a_row_stop_the_run(data, tmp_path):
    save_dir = tmp_path / "run"
    result = run_in_this_process(flags(data, save_dir, "--batch_size", "4", "--max_steps", "10", "--save_interval",
                                       "1", "--keep_last", "20", "--max_bad_steps", "3"),
                                 MINISFT_FAULT_NAN_STEPS="2,4,5,6")
    assert result.returncode == 1, result.stderr[-3000:]
    assert last_line(result.stderr) == (
        f"error: 3 optimizer steps in a row had a non-finite loss or gradient norm (last at step 6); stopped. "
        f"The last good weights are saved in {save_dir}"
    )
    assert "Traceback" not in result.stderr
    assert ("warning: step 2 had a non-finite loss or gradient norm: optimizer step skipped (1 in a row, 1 in total)"
            in result.stdout)
    saved = {step: load_resume_checkpoint(checkpoint_at(save_dir, step)) for step in range(1, 7)}
    # an isolated bad step: neither the weights nor the optimizer moved, and training went on
    assert_weights_equal(saved[2]["model"], saved[1]["model"])
    assert all(torch.equal(saved[2]["optimizer"]["state"][i]["exp_avg"], saved[1]["optimizer"]["state"][i]["exp_avg"])
               for i in saved[1]["optimizer"]["state"])
    assert not torch.equal(saved[3]["model"]["lm_head.weight"], saved[2]["model"]["lm_head.weight"])
    # three in a row: the run stopped and saved the last good state (that of step 3)
    assert_weights_equal(saved[6]["model"], saved[3]["model"])
    assert saved[6]["step"] == 6 and saved[6]["skipped_steps"] == 4
    assert [saved[step]["bad_steps_in_a_row"] for step in range(1, 7)] == [0, 1, 0, 1, 2, 3]
    # the count survives a resume: two bad steps saved at step 5, one more after it stops the run
    resumed = run_in_this_process(flags(data, tmp_path / "resumed", "--batch_size", "4", "--max_steps", "10",
                                        "--max_bad_steps", "3", "--resume_from", checkpoint_at(save_dir, 5)),
                                  MINISFT_FAULT_NAN_STEPS="6")
    assert resumed.returncode == 1 and "(last at step 6)" in last_line(resumed.stderr), resumed.stderr[-2000:]
    assert not os.path.exists(checkpoint_at(save_dir, 7))
    rows = {row["step"]: row for row in map(json.loads, open(save_dir / "metrics.jsonl", encoding="utf-8"))}
    assert [rows[step]["skipped_steps"] for step in range(1, 6)] == [0, 1, 1, 2, 3]
    assert [rows[step]["loss"] is None for step in range(1, 6)] == [False, True, False, True, True]
    # no NaN in any weights file
    assert all(all_finite(state) for state in saved.values())
    assert all_finite(load_file(save_dir / "model" / "model.safetensors"))


ALLOCATOR = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
             "1.06 GiB is free.")  # the first sentences of tests/helpers/faults.py's planted error


def out_of_memory_line(data, save_dir, fault: dict, *extra) -> str:
    """The last line of a run of the faulty trainer (batch 4, in this process: a traceback would fail the
    test) that must stop with exit 1, no traceback."""
    result = run_in_this_process(flags(data, save_dir, "--batch_size", "4", *extra), **fault)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return last_line(result.stderr)


def test_a_step_out_of_gpu_memory_is_one_line_naming_the_flags_and_the_checkpoints_stay(data, tmp_path):
    save_dir, fault = tmp_path / "run", {"MINISFT_FAULT_OOM_STEP": "3"}
    assert out_of_memory_line(data, save_dir, fault, "--max_steps", "10", "--save_interval", "2") == (
        f"error: step 3 ran out of memory on cpu ({ALLOCATOR}): a batch's activations grow with --batch_size 4 x "
        "--max_seq_len 512; lower --batch_size (raise --accumulation_steps to keep the batch per step), lower "
        "--max_seq_len, or give --gradient_checkpointing 1"
    )
    assert load_resume_checkpoint(checkpoint_at(save_dir, 2))["step"] == 2
    assert sorted(os.listdir(save_dir / "checkpoints")) == ["step_00000002.pt"]
    again = out_of_memory_line(data, tmp_path / "again", fault, "--max_steps", "10", "--gradient_checkpointing", "1")
    assert again.endswith("lower --batch_size (raise --accumulation_steps to keep the batch per step) or lower "
                          "--max_seq_len")


def test_a_step_out_of_host_memory_on_the_cpu_is_one_line_and_the_checkpoints_stay(data, tmp_path):
    """torch's CPU allocator raises a plain RuntimeError ("[enforce fail at alloc_cpu.cpp:N] ...
    DefaultCPUAllocator: can't allocate memory"): the same one line as a GPU's, from the allocator's words on."""
    save_dir = tmp_path / "run"
    line = out_of_memory_line(data, save_dir, {"MINISFT_FAULT_CPU_OOM_STEP": "3"}, "--max_steps", "10",
                              "--save_interval", "2")
    assert line == (
        "error: step 3 ran out of memory on cpu (DefaultCPUAllocator: can't allocate memory: you tried to allocate "
        "1125899906842624 bytes. Error code 12 (Cannot allocate memory)): a batch's activations grow with "
        "--batch_size 4 x --max_seq_len 512; lower --batch_size (raise --accumulation_steps to keep the batch per "
        "step), lower --max_seq_len, or give --gradient_checkpointing 1"
    )
    assert sorted(os.listdir(save_dir / "checkpoints")) == ["step_00000002.pt"]


def test_a_save_out_of_gpu_memory_is_one_line_and_the_earlier_checkpoint_stays(data, tmp_path):
    save_dir = tmp_path / "run"
    line = out_of_memory_line(data, save_dir, {"MINISFT_FAULT_OOM_SAVE_STEP": "4"}, "--max_steps", "10",
                              "--save_interval", "2")
    assert line == (
        f"error: the save at step 4 ran out of memory on cpu ({ALLOCATOR}): a save holds one weight at a time cast "
        "to --save_dtype bfloat16 on the device beside the weights and optimizer state; --save_dtype float32 casts "
        "none; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lessens fragmentation. The files already in "
        f"{save_dir} are kept"
    )
    assert load_resume_checkpoint(checkpoint_at(save_dir, 2))["step"] == 2
    assert sorted(os.listdir(save_dir / "checkpoints")) == ["step_00000002.pt"]
    assert (save_dir / "model" / "model.safetensors").is_file()  # step 2's inference weights
    best = out_of_memory_line(data, tmp_path / "best", {"MINISFT_FAULT_OOM_BEST": "1"}, "--max_steps", "6",
                              "--eval_interval", "2", "--eval_data_path", str(data / "train.jsonl"),
                              "--keep_best", "eval_loss", "--save_dtype", "float32")  # exit 1, as every OOM
    assert best.startswith(f"error: the save of best/ at step 2 ran out of memory on cpu ({ALLOCATOR}): a save "
                           "holds one weight at a time cast to --save_dtype float32 on the device beside the weights "
                           "and optimizer state; PYTORCH_CUDA_ALLOC_CONF"), best


def test_an_evaluation_out_of_gpu_memory_is_one_line_too(data, tmp_path):
    line = out_of_memory_line(data, tmp_path / "run", {"MINISFT_FAULT_OOM_EVAL_STEP": "2"}, "--max_steps", "6",
                              "--eval_interval", "2", "--eval_data_path", str(data / "train.jsonl"))
    assert line == (
        f"error: the evaluation at step 2 ran out of memory on cpu ({ALLOCATOR}): a batch's activations grow with "
        "--batch_size 4 x --max_seq_len 512; lower --batch_size (raise --accumulation_steps to keep the batch per "
        "step) or lower --max_seq_len"
    )


def test_several_processes_out_of_memory_in_their_first_forward_and_backward_say_it_in_one_line(data, tmp_path):
    """With several processes the run's first forward and backward is DDP's, which settles its
    gradient layout before step 1: a batch too large for the device runs out of memory there first.
    Each rank stops with exit 1 and the one line of a step out of memory, no traceback."""
    ranks = run_ranks_apart(FAULTY_TRAINER, flags(data, tmp_path / "run", "--batch_size", "2", "--max_steps", "4"),
                            local_ranks=(0, 1), MINISFT_FAULT_OOM_LAYOUT="1")
    stderr = "".join(rank.stderr for rank in ranks)
    assert [rank.returncode for rank in ranks] == [1, 1] and "Traceback" not in stderr, stderr[-3000:]
    line = (f"error: step 1 ran out of memory on cpu ({ALLOCATOR}): a batch's activations grow with --batch_size 2 x "
            "--max_seq_len 512; lower --batch_size (raise --accumulation_steps to keep the batch per step), lower "
            "--max_seq_len, or give --gradient_checkpointing 1")
    assert [text for text in stderr.splitlines() if text.startswith("error")] == [line, line]


@pytest.mark.parametrize("fault, line", [
    ({"MINISFT_FAULT_NAN_STEPS": "3,4"}, "error: 2 optimizer steps in a row had a non-finite loss or gradient norm "
                                         "(last at step 4); stopped. The last good weights are saved in {save_dir}"),
    ({"MINISFT_FAULT_OOM_BEST": "1"}, "error: the save of best/ at step 2 ran out of memory on cpu ({allocator}): a "
                                      "save holds one weight at a time cast to --save_dtype bfloat16 on the device "
                                      "beside the weights and optimizer state; --save_dtype float32 casts none; "
                                      "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lessens fragmentation. The "
                                      "files already in {save_dir} are kept"),
])
def test_a_stop_every_rank_shares_is_said_once(data, tmp_path, fault, line):
    """Two ranks as two plain processes (the launcher is not what is checked): both stop with exit 1,
    and of their two stderr streams together one line is an error."""
    save_dir = tmp_path / "run"
    ranks = run_ranks_apart(FAULTY_TRAINER, flags(data, save_dir, "--batch_size", "2", "--max_steps", "6",
                                                  "--max_bad_steps", "2", "--eval_interval", "2", "--eval_data_path",
                                                  str(data / "eval.jsonl"), "--keep_best", "eval_loss"),
                            local_ranks=(0, 1), **fault)
    stderr = "".join(rank.stderr for rank in ranks)
    assert [rank.returncode for rank in ranks] == [1, 1], stderr[-3000:]
    errors = [text for text in stderr.splitlines() if text.startswith("error")]
    assert errors == [line.format(save_dir=save_dir, allocator=ALLOCATOR)]
