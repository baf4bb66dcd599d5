"""Which launcher started this process and where it puts it: rank, local rank, number of
processes, read from the launcher's environment variables and checked before anything waits on
a peer (a launch that cannot work is one line here, not a rendezvous that waits --dist_timeout or
a node whose ranks wait for a token cache that no process builds, dataset/cache/node.py)."""

import os
import subprocess

from trainer.errors import DistributedError, NodeLaunchError
from trainer.runtime.node_lines import SLURM_NAMES, TORCHRUN_NAMES, launcher_names, local_rank_from


def launch_env(args) -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the launcher's environment variables (checked first,
    `check_launch_variables`); (0, 0, 1) without a launcher."""
    env = os.environ
    check_launch_variables(env, args.world_size, args.local_rank)
    names = launcher_names(env)
    if names is None:
        return 0, 0, 1
    rank, local, world = int(env[names[0]]), local_rank_from(env, args.local_rank), int(env[names[1]])
    if names == SLURM_NAMES:
        # torch's env:// rendezvous reads these four variables.
        env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = str(rank), str(world), str(local)
        env.setdefault("MASTER_ADDR", slurm_master_addr())
        env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))
    return rank, local, world


def check_launch_variables(env, world_size_flag: int = 1, local_rank_flag: int | None = None) -> None:
    """The launcher's variables must describe a launch that can work: whole numbers, RANK and
    WORLD_SIZE both or neither, the rank below the number of processes, the local rank within the
    node's (RANK - LOCAL_RANK is the node's first rank: dataset/cache/node.py), and a --world_size
    N beside a launcher the same N. Else one line, here, where the rendezvous would wait
    --dist_timeout for peers that cannot come (RANK=5 of WORLD_SIZE=2) or fail in int()."""
    if ("RANK" in env) != ("WORLD_SIZE" in env):
        given, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
        raise DistributedError(f"{given}={env[given]} is in the environment but {missing} is not: a launcher sets "
                               "both (torchrun); unset it to run one process, or start N with --world_size N")
    if "RANK" in env:
        rank, world, local = TORCHRUN_NAMES
    elif "SLURM_PROCID" in env:
        rank, world, local = SLURM_NAMES
    else:
        return
    local_world = "LOCAL_WORLD_SIZE" if rank == "RANK" else None
    for name, least in ((world, 1), (rank, 0), (local, 0), (local_world, 1)):
        if name and name in env and not (env[name].strip().isdigit() and int(env[name]) >= least):
            raise DistributedError(f"{name}={env[name]!r} in the environment is not a whole number >= {least} "
                                   "(the launcher sets it: torchrun, srun or your own script)")
    if world in env and int(env[rank]) >= int(env[world]):
        raise DistributedError(f"{rank}={env[rank]} is not below {world}={env[world]}: the ranks of {env[world]} "
                               f"processes are 0 to {int(env[world]) - 1} (the launcher sets them)")
    launched = int(env.get(world, "1"))
    if world_size_flag > 1 and launcher_names(env) is not None and world_size_flag != launched:
        raise NodeLaunchError(f"--world_size {world_size_flag} but the launcher started {launched} processes "
                              f"({world}={launched}): leave --world_size out under a launcher, it sets the number")
    check_node_arithmetic(env, rank, world, local, local_world, local_rank_flag)


def check_node_arithmetic(env, rank: str, world: str, local: str, local_world: str | None,
                          local_rank_flag: int | None) -> None:
    """The local rank (`local` or the legacy --local_rank) at most the rank, below the node's number
    of processes (`local_world`, where given), and the node's ranks below the run's number."""
    if local in env:
        local_name, local_rank = local, int(env[local])
    elif rank == "RANK" and local_rank_flag is not None:
        local_name, local_rank = "--local_rank", local_rank_flag
    else:
        return
    if local_rank > int(env[rank]):
        raise DistributedError(f"{local_name}={local_rank} is above {rank}={env[rank]}: a process's rank on its node "
                               "cannot exceed its rank in the run (the launcher sets them)")
    if not local_world or local_world not in env:
        return
    on_node = int(env[local_world])
    if on_node > int(env[world]):
        raise NodeLaunchError(f"{local_world}={on_node} is above {world}={env[world]}: a node cannot hold more "
                              "processes than the run (the launcher sets them)")
    if local_rank >= on_node:
        raise DistributedError(f"{local_name}={local_rank} is not below {local_world}={on_node}: the local ranks of "
                               f"{on_node} processes are 0 to {on_node - 1} (the launcher sets them)")
    if int(env[rank]) - local_rank + on_node > int(env[world]):
        raise DistributedError(f"{rank}={env[rank]} with {local_name}={local_rank} and {local_world}={on_node} puts "
                               f"this node's ranks past {world}={env[world]} (the launcher sets them)")


def slurm_master_addr() -> str:
    """The first host of the SLURM allocation."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if nodelist:
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
