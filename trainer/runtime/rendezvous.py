"""Reaching rank 0's store before the process group starts (trainer/runtime/distributed.py
`init_distributed`): a rank other than 0 waits, at most --dist_timeout, for the store at
MASTER_ADDR:MASTER_PORT to answer (`wait_for_master`); under torchrun the workers' store is
the agent's, with a key prefix per restart (`elastic_store`)."""

import datetime
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

from trainer.errors import first_line


def wait_for_master(addr: str | None, port: str | None, timeout_s: float) -> None:
    """Wait until rank 0's store at addr:port accepts connections and answers, at most `timeout_s`.
    torch's store client retries a refused connection with a growing backoff and gives up at about
    twice its timeout; once connected, it waits for the store's first answer with no timeout at
    all, so a port that accepts and stays silent (another program on MASTER_PORT, a stale port
    forward) would hold this rank forever (`store_answers`). An address or port that is missing or
    not a port is left to torch's rendezvous to report."""
    if not addr or not (port or "").isdigit():
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, int(port)), timeout=max(0.1, deadline - time.monotonic())):
                break
        except OSError as error:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"nothing answered at {addr}:{port} ({first_line(error)})") from error
            time.sleep(min(0.5, remaining))
    store_answers(addr, int(port), deadline)


def store_answers(addr: str, port: int, deadline: float) -> None:
    """A store client of addr:port is made by `deadline` (monotonic), else TimeoutError: made in a
    thread of its own, the client has its answer once the store replied to its first requests. A
    client that gets none stays blocked in libtorch, in a daemon thread that the rank, failing with
    its line, leaves behind."""
    outcome: dict = {}

    def connect() -> None:
        try:
            dist.TCPStore(addr, port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(0.1, deadline - time.monotonic())))
            outcome["error"] = None
        except Exception as error:  # noqa: BLE001 - raised in the rank's own thread below
            outcome["error"] = error

    client = threading.Thread(target=connect, name="minisft-store-answers", daemon=True)
    client.start()
    client.join(max(0.0, deadline - time.monotonic()))
    if "error" not in outcome:
        raise TimeoutError(f"{addr}:{port} accepts connections but does not answer as torch's store (another "
                           "program on MASTER_PORT?)")
    if outcome["error"] is not None:
        raise outcome["error"]


def elastic_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dict:
    """Under `torchrun --max-restarts N`: the store arguments of init_process_group for this attempt.

    torchrun's workers share the agent's TCPStore across restarts, and torch keys the process
    group's entries the same way in every attempt, so a restarted group can read the dead
    group's addresses (gloo: "connectFullMesh failed ... Connection refused"). A prefix per
    attempt (TORCHELASTIC_RESTART_COUNT, the same on every agent) keeps the attempts apart.
    Elsewhere: {} (the default env:// rendezvous).
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    if rank == 0 and int(env.get("GROUP_WORLD_SIZE", "1")) > 1 and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        # Each agent counts only its own restarts; a node whose workers were restarted for a
        # failure elsewhere may count differently, and then the attempts' prefixes differ.
        print("warning: torchrun on several nodes with --max-restarts shares one store across restarts; "
              "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for every torchrun (with --rdzv-backend c10d) so that "
              "each restart gets a fresh one", file=sys.stderr, flush=True)
    agent_store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False,
                                timeout=timeout)
    store = dist.PrefixStore(f"minisft/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent_store)
    return {"store": store, "rank": rank, "world_size": world_size}
