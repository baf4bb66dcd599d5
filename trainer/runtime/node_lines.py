"""One line per node for an error that every process of the node meets alike before the process
group starts: a flag out of range, more processes than the node's GPUs. The processes of a node
share their flags, environment and devices, so each of them would print the same line; local rank
0 prints it, the others exit with the same code silently, after a short wait: the first process
to exit makes torchrun stop the others with SIGTERM, and local rank 0 should have printed by then
(the trainer catches SIGTERM from its first line on, trainer/runtime/preemption.py, so a stopped
process still ends as it would). Once the process group is up, ranks agree over it instead
(`distributed.print_once`). No torch here: the flag parser uses it.
"""

import os
import sys
import time

SILENT_LEAVE_AFTER_S = 1.0  # how long the silent processes wait before they exit


def prints_for_node(env=os.environ) -> bool:
    """Whether this process prints the lines its node's processes have alike: local rank 0 as its
    launcher says (torchrun, torch.distributed.launch and --world_size N: LOCAL_RANK beside RANK and
    WORLD_SIZE; srun: SLURM_LOCALID), read as `distributed.launch_env` reads it, or a process that
    no launcher started."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env.get("LOCAL_RANK", "0")) == 0
    if int(env.get("SLURM_NTASKS", "1")) > 1:
        return int(env.get("SLURM_LOCALID", "0")) == 0
    return True


def print_for_node(message: str) -> None:
    """Print ``message`` to stderr if this process prints for its node (`prints_for_node`), else
    wait ``SILENT_LEAVE_AFTER_S``."""
    if prints_for_node():
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(SILENT_LEAVE_AFTER_S)
