"""One line per node for an error that every process of the node meets alike before the process
group starts: a flag out of range, more processes than the node's GPUs. The processes of a node
share their flags, environment and devices, so each of them would print the same line; local rank
0 prints it, the others exit with the same code silently, after a short wait: the first process
to exit makes torchrun stop the others with SIGTERM, and local rank 0 should have printed by then
(the trainer catches SIGTERM from its first line on and ignores it while Python finalizes,
trainer/runtime/preemption.py, so a stopped process still ends with its own exit code). Once the
process group is up, ranks agree over it instead (`distributed.print_once`). No torch here: the
flag parser uses it.
"""

import os
import sys
import time

# How long a process that leaves the printing to another stays before it exits: the first process to
# exit makes torchrun stop the others, maybe before the printing one has printed or left.
LEAVE_AFTER_S = 1.0


# The variables (rank, number of processes, local rank) that each launcher understood sets.
TORCHRUN_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
SLURM_NAMES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def launcher_names(env=os.environ) -> tuple[str, str, str] | None:
    """The variables of the launcher that started this process with others: torchrun,
    torch.distributed.launch and --world_size N set RANK and WORLD_SIZE; srun with several tasks
    sets SLURM_PROCID and SLURM_NTASKS > 1 (one task is no launch of several). None: no launcher,
    one process (or --world_size N starts the others)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return TORCHRUN_NAMES
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return SLURM_NAMES
    return None


def local_rank_from(env=os.environ, flag_local_rank: int | None = None) -> int:
    """This process's rank on its node as its launcher (`launcher_names`) gives it: LOCAL_RANK (the
    legacy torch.distributed.launch may pass `--local_rank` instead, `flag_local_rank`) or
    SLURM_LOCALID; a process that no launcher started is 0. `launcher.launch_env` reads the local
    rank here too."""
    names = launcher_names(env)
    if names == TORCHRUN_NAMES:
        return int(env.get("LOCAL_RANK", flag_local_rank if flag_local_rank is not None else 0))
    if names == SLURM_NAMES:
        return int(env.get("SLURM_LOCALID", "0"))
    return 0


def prints_for_node(env=os.environ) -> bool:
    """Whether this process prints the lines its node's processes have alike: local rank 0
    (`local_rank_from`). A local rank that is not a number prints: the line is a flag's error, and
    `launcher.check_launch_variables` names that variable once the flags pass."""
    try:
        return local_rank_from(env) == 0
    except ValueError:
        return True


def print_for_node(message: str) -> None:
    """Print ``message`` to stderr if this process prints for its node (`prints_for_node`), else
    wait ``LEAVE_AFTER_S``."""
    if prints_for_node():
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(LEAVE_AFTER_S)
