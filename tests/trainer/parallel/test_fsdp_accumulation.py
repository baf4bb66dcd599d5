"""`--fsdp 1` with `--accumulation_steps` above 1: the gradients accumulate sharded (trainer/parallel/fsdp.py,
`FullyShardedParallel.micro_step`). That the result is the same mathematics as one process and as DDP is
tests/trainer/parallel/test_fsdp.py's equivalence test."""

import json
import os
import subprocess

import pytest

from tests.helpers.trainer_launch import REPO, clean_env, torchrun_cmd


@pytest.mark.slow
def test_between_micro_batches_each_rank_holds_only_its_shard_of_the_gradients(tmp_path):
    """Two gloo processes, the loop's steps of two micro-batches (tests/helpers/fsdp_accumulation_check.py),
    computing in float32 and in bfloat16: after the first micro-batch's backward every parameter's gradient is
    a DTensor of the rank's half of it, and FSDP2 keeps no unsharded gradient to accumulate into."""
    out = tmp_path / "held.json"
    result = subprocess.run([*torchrun_cmd(2), os.path.join(REPO, "tests", "helpers", "fsdp_accumulation_check.py"),
                             str(out)], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    nothing_held = {"not_sharded": [], "unsharded": []}
    per_step = {"float32": [nothing_held] * 2, "bfloat16": [nothing_held] * 2}
    assert json.loads(out.read_text()) == [per_step, per_step]
