"""Step 1: who am I (rank, local rank, world size), which device, and the process group.

Launchers understood:
- `torchrun` and the legacy `python -m torch.distributed.launch` (RANK / WORLD_SIZE /
  LOCAL_RANK in the environment; the legacy one passes `--local_rank` instead of LOCAL_RANK);
- SLURM `srun` (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID) when RANK is absent;
- `--world_size N` with plain `python`: this process starts N local workers itself;
- plain `python`: one process, cuda:0 if present, else CPU.
"""

import datetime
import itertools
import json
import logging
import os
import re
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dataset.cache import waiting
from dataset.printable import print_escaped
from trainer.errors import DistributedError, NodeLaunchError, first_line
from trainer.runtime.groups import close_process_groups, host_group, open_host_group
from trainer.runtime.native_log import native_frames_dropped
from trainer.runtime.launcher import launch_env
from trainer.runtime.node_lines import LEAVE_AFTER_S, launcher_names
from trainer.runtime.preemption import forward_to
from trainer.runtime.rendezvous import elastic_store, wait_for_master


@dataclass
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(args, local_rank: int, env=os.environ) -> torch.device:
    """The device of this process. `--device` is already checked (auto | cpu | cuda | cuda:N). A
    device that cannot be had is refused alike on each process of the node (`NodeLaunchError`)."""
    if args.device not in ("auto", "cuda"):
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise NodeLaunchError(f"--device {args.device} asked for, but CUDA is not available")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise NodeLaunchError(f"--device {args.device}: only {torch.cuda.device_count()} GPU(s) visible "
                                   f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        if device.type == "cuda" and args.backend != "gloo":
            refuse_one_gpu_for_the_node(args.device, local_rank, env)
        return device
    if torch.cuda.is_available():
        visible = torch.cuda.device_count()
        index = gpu_for_local_rank(local_rank, processes_on_this_node(env), visible, gpus_given_per_task(env, visible),
                                   env.get("CUDA_VISIBLE_DEVICES", "unset"))
        return torch.device("cuda", index)
    if args.device == "cuda":
        raise NodeLaunchError("--device cuda asked for, but CUDA is not available")
    return torch.device("cpu")


def refuse_one_gpu_for_the_node(device: str, local_rank: int, env) -> None:
    """An explicit `--device cuda:N` gives every process of the node the same GPU, which NCCL
    refuses (with an error that blames the rendezvous): refused here in one line when the node has
    several processes that do not each see a GPU of their own (srun --gpus-per-task)."""
    needed, refusal = processes_sharing_the_node(local_rank, processes_on_this_node(env))
    if needed > 1 and not gpus_given_per_task(env, torch.cuda.device_count()):
        raise refusal(f"--device {device} puts the {needed} processes of this node on one GPU, which NCCL refuses: "
                      "leave --device out (local rank r takes cuda:r), or use --backend gloo")


def gpu_for_local_rank(local_rank: int, local_processes: int | None, visible: int, per_task: bool,
                       visible_env: str = "unset") -> int:
    """The visible GPU index of local rank `local_rank`.

    `per_task`: the launcher gave each process its own GPU(s) (srun --gpus-per-task 1), so the
    process's first visible GPU is its own, whatever its local rank. Otherwise the node's
    `local_processes` (None: the launcher does not say; at least local_rank + 1) share the
    `visible` GPUs, one each, `cuda:local_rank`; more processes than GPUs is refused here, before
    the process group starts (two ranks on one GPU fail later in NCCL with a misleading error): when
    the launcher says how many processes the node has, each of them refuses alike (`NodeLaunchError`).
    """
    if per_task:
        return 0
    needed, refusal = processes_sharing_the_node(local_rank, local_processes)
    if needed > visible:
        raise refusal(
            f"{needed} processes on this node but this process sees {visible} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={visible_env}): start at most {visible} per node (torchrun --nproc_per_node "
            f"{visible}, srun --ntasks-per-node {visible}), or give each process its own GPU (srun --gpus-per-task 1)"
        )
    return local_rank


def processes_sharing_the_node(local_rank: int, local_processes: int | None) -> tuple[int, type[DistributedError]]:
    """How many processes share this node as far as is known (the launcher's count, else at least
    local_rank + 1), and what a launch that cannot work with that many raises: `NodeLaunchError`
    when the launcher says the count (every process of the node refuses alike), else
    `DistributedError` (only the processes that meet it refuse)."""
    if local_processes is None:
        return local_rank + 1, DistributedError
    return max(local_processes, local_rank + 1), NodeLaunchError


def processes_on_this_node(env) -> int | None:
    """How many processes of this run share this node: torchrun and --world_size N say it in
    LOCAL_WORLD_SIZE; srun in SLURM_STEP_TASKS_PER_NODE (e.g. "8(x2),4", indexed by SLURM_NODEID).
    None when no launcher says."""
    if "LOCAL_WORLD_SIZE" in env:
        return int(env["LOCAL_WORLD_SIZE"])
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if int(env.get("SLURM_NTASKS", "1")) <= 1 or not tasks:
        return None
    per_node = []
    for part in tasks.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not found:
            return None
        per_node += [int(found.group(1))] * int(found.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return per_node[node] if node < len(per_node) else None


def gpus_given_per_task(env, visible: int) -> bool:
    """Whether srun gave this task GPUs of its own, so that it sees only those: `--gpus-per-task N`
    (SLURM_GPUS_PER_TASK, "N" or "TYPE:N") with at most N GPUs visible, or a binding that shows the
    task fewer GPUs than its step holds on this node (SLURM_STEP_GPUS). A task that sees more than
    its N (`--gpu-bind=none`, or a SLURM that does not bind --gpus-per-task) shares the node's GPUs
    with the node's other tasks: cuda:0 for each would put them all on one GPU. Never under torchrun
    (LOCAL_WORLD_SIZE): its processes share what the agent sees."""
    if "LOCAL_WORLD_SIZE" in env or int(env.get("SLURM_NTASKS", "1")) <= 1:
        return False
    per_task = env.get("SLURM_GPUS_PER_TASK")
    if per_task:
        count = re.fullmatch(r"(?:[^:,]+:)?(\d+)", per_task.strip())
        return count is None or visible <= int(count.group(1))
    step_gpus = [gpu for gpu in env.get("SLURM_STEP_GPUS", "").split(",") if gpu]
    return bool(step_gpus) and visible < len(step_gpus)


def init_distributed(args) -> DistContext:
    """Init the process group (if launched with more than one process) and pick the device."""
    rank, local_rank, world_size = launch_env(args)
    device = pick_device(args, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1:
        return DistContext(0, 0, 1, device, None)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise NodeLaunchError("--backend nccl needs CUDA devices; use --backend gloo on CPU")
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    try:
        with native_frames_dropped():
            if rank != 0:
                wait_for_master(os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), args.dist_timeout)
            dist.init_process_group(backend=backend, timeout=timeout, device_id=device if backend == "nccl" else None,
                                    **elastic_store(rank, world_size, timeout))
            # Rendezvous only proves the store is up; a collective proves every peer is here.
            barrier(device)
    except Exception as error:  # noqa: BLE001 - turned into one clear line
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise DistributedError(
            f"rank {rank}: the {world_size} processes did not all join the process group at {where} "
            f"within --dist_timeout {args.dist_timeout:g}s ({type(error).__name__}: {first_line(error)})"
        ) from error
    try:
        with native_frames_dropped():
            open_host_group(backend, timeout)
    except Exception as error:  # noqa: BLE001 - turned into one clear line
        raise DistributedError(host_group_failure(rank, world_size, backend, args.dist_timeout, error)) from error
    return DistContext(rank, local_rank, world_size, device, backend)


def host_group_failure(rank: int, world_size: int, backend: str, timeout_s: float, error: BaseException) -> str:
    """The line for a gloo group beside the `backend` (NCCL) group that could not connect, once the
    `backend` group is up. NCCL chooses a network interface of its own; gloo listens on, and tells the
    other ranks, the address that this host's name resolves to, which /etc/hosts often maps to a
    loopback address (127.0.1.1): then the ranks of one node reach each other and no other node does.
    GLOO_SOCKET_IFNAME names the interface to use instead."""
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
        resolved = f"{host} resolves to {address}{', a loopback address' if address.startswith('127.') else ''}"
    except OSError:
        resolved = f"{host} does not resolve to an address"
    return (f"rank {rank}: the {world_size} processes joined the {backend} process group, but not the gloo group "
            f"beside it (the loop's host values) within --dist_timeout {timeout_s:g}s "
            f"({type(error).__name__}: {first_line(error)}): gloo connects through the address this host's name "
            f"resolves to ({resolved}); set GLOO_SOCKET_IFNAME to the network interface the nodes reach each "
            "other on (e.g. GLOO_SOCKET_IFNAME=eth0) for every process")


# What the transports put in the plain RuntimeError they raise when a peer dies, closes its
# connection or hangs past --dist_timeout. Specific phrases only: a bare "gloo" or "NCCL" also
# appears in errors that are bugs in our own code (wrong device, wrong dtype, invalid usage),
# and those must keep their traceback.
PEER_FAILURE_MARKERS = (
    "Connection reset by peer", "Connection closed by peer", "Connection refused", "Broken pipe",
    "Timed out waiting", "timed out after", "Watchdog caught collective operation timeout",
    "NCCL communicator was aborted", "ncclRemoteError", "ncclSystemError",
)


def is_peer_failure(error: BaseException) -> bool:
    """Whether `error` comes from a collective that lost a peer (killed, crashed, hung past --dist_timeout).

    gloo raises a plain RuntimeError for that (e.g. "[.../gloo/transport/tcp/pair.cc:537] Read error
    ...: Connection reset by peer"), not a torch.distributed.DistError.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if isinstance(error, (dist.DistNetworkError, dist.DistStoreError)):
        return True
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in PEER_FAILURE_MARKERS)


def peer_failure_message(error: BaseException) -> str:
    """One line for a lost peer, without the C++ source location that gloo puts first."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    detail = re.sub(r"^\[[^\]]*\]\s*", "", first_line(error)).split(". ")[0]
    return f"rank {rank}: a peer process failed or stopped responding ({type(error).__name__}: {detail})"


ONCE_KEY = "minisft/said-once/rank{}"
ONCE_WAIT_S = 10.0  # the most a rank waits for the others while a line every rank has is printed once
ONCE_POLL_S = 0.05


def print_once(message: str) -> None:
    """Print to stderr an error line that ranks may share (every rank failing on the same data) once.

    Rank 0 prints its line and publishes it in the store; another rank prints its own line only if
    it differs from rank 0's (a file missing on one node only), or if rank 0 has published none
    within ``ONCE_WAIT_S`` (rank 0 did not fail). Rank 0 then waits, as long at most, until the
    others have read it: a rank that exits first makes torchrun stop rank 0, maybe before it
    prints. A store that cannot be reached any more ends the wait."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        print(message, file=sys.stderr, flush=True)
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    printed = rank == 0
    try:
        store = dist.distributed_c10d._get_default_store()
        waiting_for = [ONCE_KEY.format(other) for other in range(1, world_size)] if rank == 0 else [ONCE_KEY.format(0)]
        if rank == 0:
            store.set(ONCE_KEY.format(0), message)
        deadline = time.monotonic() + ONCE_WAIT_S
        while not store.check(waiting_for) and time.monotonic() < deadline:
            time.sleep(ONCE_POLL_S)
        if rank:
            said = store.get(ONCE_KEY.format(0)).decode() if store.check(waiting_for) else None
            if said != message:
                print(message, file=sys.stderr, flush=True)
            printed = True
            store.set(ONCE_KEY.format(rank), "seen")
            # Rank 0 leaves as soon as it sees that; leave after it: a rank that exits first makes
            # torchrun stop the others with SIGTERM, maybe while rank 0 is still leaving.
            time.sleep(LEAVE_AFTER_S)
    except RuntimeError:  # the store is gone with rank 0 (which had printed), or never answered
        if not printed:
            print(message, file=sys.stderr, flush=True)


def barrier(device: torch.device | None = None) -> None:
    if dist.is_available() and dist.is_initialized():
        if device is not None and device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_sum_on_host(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a CPU tensor over the ranks without touching a device (`host_group`)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=host_group())
    return tensor


def all_gather_objects(obj, on_host: bool = False) -> list:
    """Every rank's `obj`, in rank order; `on_host`: through `host_group`, without touching a device."""
    if dist.is_available() and dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj, group=host_group() if on_host else None)
        return gathered
    return [obj]


_RANK0_VALUES = itertools.count()  # every rank calls rank0_value in the same order: the same keys


def rank0_value(value, what: str):
    """Rank 0's `value` (anything JSON holds) on every rank, through the process group's store
    rather than a collective: rank 0 may come to it long after the others (its checkpoint write
    on a slow filesystem), and a rank waiting in a collective meets --dist_timeout (under NCCL its
    watchdog kills it). The others wait for the key, saying on stderr that they wait for rank 0 to
    finish `what` after `waiting.WAIT_FIRST_S`, then every `waiting.WAIT_REPORT_S`."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    store = dist.distributed_c10d._get_default_store()
    key = f"minisft/rank0-value/{next(_RANK0_VALUES)}"
    if dist.get_rank() == 0:
        store.set(key, json.dumps(value))
        return value
    waiting.poll(lambda: store.check([key]), f"rank {dist.get_rank()}: waiting for rank 0 to finish {what}")
    return json.loads(store.get(key))


def broadcast_object(obj, src: int = 0):
    if dist.is_available() and dist.is_initialized():
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]
    return obj


def cleanup(ctx: DistContext) -> None:
    """Step 9: wait for everyone, then tear the process groups down (`close_process_groups`)."""
    if dist.is_available() and dist.is_initialized():
        barrier(ctx.device)
    close_process_groups()


# --------------------------------------------------------------------------- self-spawn


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawned_by_us() -> bool:
    """Whether `--world_size N` starts the workers here: no launcher started this process with
    others (`launcher_names`). RANK or WORLD_SIZE alone, or a SLURM_NTASKS that is not a number,
    is left to the launch check, which refuses it in one line."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return False
    try:
        return launcher_names(os.environ) is None
    except ValueError:
        return False


def _spawned_worker(local_rank: int, world_size: int, port: int, entry, argv) -> None:
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    code = entry(argv)
    if code:
        raise SystemExit(code)


def spawn_local_workers(entry, argv, world_size: int) -> int:
    """`--world_size N` without a launcher: run `entry(argv)` in `world_size` local processes; return an
    exit code.

    SIGTERM or SIGINT to this launcher (its pid or its process group) is passed on to the
    workers as SIGTERM: they stop at the next step boundary, save, and exit 0, and so does this."""
    port = free_port()
    # torch logs a warning for each worker it stops once another has failed: the failed worker's own
    # line says why, and is the only line.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        context = mp.start_processes(_spawned_worker, args=(world_size, port, entry, argv), nprocs=world_size,
                                     join=False, start_method="spawn")
        forward_to([process.pid for process in context.processes])
        while not context.join():
            pass
    except mp.ProcessExitedException as error:
        return error.exit_code if error.exit_code and error.exit_code > 0 else 1
    except mp.ProcessRaisedException as error:  # a bug: the worker's traceback, as one process shows it
        print_escaped("error: a worker failed" + str(error).rstrip(), file=sys.stderr)
        return 1
    return 0
