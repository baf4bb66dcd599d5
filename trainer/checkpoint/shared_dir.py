"""What the nodes of a run must see alike: --save_dir, where ranks other than 0 use it, and the resume
checkpoint.

Rank 0 alone creates --save_dir, locks it, publishes and rotates checkpoints there. Two things make
the other ranks use it too: with `--fsdp 1` every rank writes its shards of each checkpoint into
`step_N.dcp.tmp/` there (trainer/checkpoint/sharded.py), and a resume (`--from_resume 1`) has every
rank read the checkpoint that rank 0 chose there. A --save_dir local to each node would give
checkpoints without the other nodes' shards (found only at the resume, and each save leaving a
`.tmp` directory on every other node), or a resume that fails on the other nodes. With DDP and no
--from_resume, rank 0 alone writes checkpoints there and reads them, and a directory of its node is
enough (a MiniMind `--from_weight NAME` found there is read by every rank, like any --from_weight
file: a copy on each node serves). The token cache (--cache_dir) need not be shared either: local
rank 0 of each node builds the cache its node reads (dataset/cache/node.py).

The check (`check_every_rank_sees`), before anything is written or resumed: rank 0 writes a file
of a random name into --save_dir and gives the name to the others through the store
(`rank0_value`); each rank reads it back, and one gather over the ranks (gloo, never the GPU) gives
every rank each rank's answer and host. Rank 0 then removes the file, and if any rank did not see
it, every rank stops with the same line, naming those ranks and their hosts.

The resume checkpoint (`read_on_every_rank`): rank 0 chooses it and every rank reads it at the same
path (with --resume_from, a path on each node's own filesystem is allowed: a copy on each node
serves). One gather tells every rank which checkpoint (run and step) each rank read, or why it could
not: a node without the file, or with another save at that path, stops every rank with the same
line. Without it the rank that cannot read stops alone while the others wait for it, and a rank that
reads another checkpoint trains from other weights, optimizer state and sample position than rank 0.
"""

import contextlib
import os
import secrets
import socket

from trainer.checkpoint.resume import load_resume_checkpoint
from trainer.checkpoint.save_dir import run_label
from trainer.errors import CheckpointError
from trainer.runtime.distributed import all_gather_objects, rank0_value

PROBE_PREFIX = ".same_dir_check."
HOSTS_NAMED = 3  # the most hosts a refusal names; the others are counted


def why_every_rank_uses(args) -> str | None:
    """What makes ranks other than 0 use --save_dir in this run (the end of the refusal's line), else None."""
    if args.fsdp:
        return "with --fsdp 1 every rank writes its shards of each checkpoint there"
    if args.from_resume:
        return "with --from_resume 1 every rank reads the resume checkpoint there"
    return None


def check_every_rank_sees(save_dir: str, why: str | None, ctx) -> None:
    """Fail every rank with one CheckpointError when some rank does not see the file that rank 0 wrote into
    `save_dir` (module docstring). Collective over the ranks of a multi-process run; nothing when `why`
    (`why_every_rank_uses`) is None."""
    if not ctx.distributed or why is None:
        return
    written = None
    if ctx.is_main:
        name = PROBE_PREFIX + secrets.token_hex(8)
        with open(os.path.join(save_dir, name), "w", encoding="utf-8") as handle:
            handle.write(name)
        written = {"name": name, "host": socket.gethostname(), "save_dir": save_dir}
    written = rank0_value(written, "checking --save_dir")
    seen = sees(os.path.join(save_dir, written["name"]), written["name"])
    answers = all_gather_objects((seen, socket.gethostname()), on_host=True)
    if ctx.is_main:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(save_dir, written["name"]))
    ranks = [rank for rank, (saw, _) in enumerate(answers) if not saw]
    if ranks:  # every rank holds every answer: each makes rank 0's line (its --save_dir, as it names it)
        where = ranks_on_hosts(ranks, hosts_of(answers, ranks))
        raise CheckpointError(f"--save_dir {written['save_dir']} is not the same directory on every node "
                              f"({where} {'does' if len(ranks) == 1 else 'do'} not see the "
                              f"file that rank 0 on host {written['host']} wrote there), and {why}: give a directory "
                              "on a filesystem that all nodes share")


def read_on_every_rank(path: str, saved: dict | None, ctx) -> dict:
    """The resume checkpoint at `path` as this rank reads it: `saved` where rank 0 has read it already,
    else read here. In a multi-process run, a CheckpointError on every rank when some rank cannot read it
    or reads another checkpoint than rank 0 (module docstring); collective over the ranks."""
    problem = None
    if saved is None:
        try:
            saved = load_resume_checkpoint(path)
        except CheckpointError as error:
            if not ctx.distributed:
                raise
            problem = str(error)
    if not ctx.distributed:
        return saved
    which = None if problem else f"step {saved['step']} of run {run_label(saved.get('run_id'))}"
    answers = all_gather_objects((problem, which, socket.gethostname()), on_host=True)
    unread = [rank for rank, (problem_there, _, _) in enumerate(answers) if problem_there]
    if unread:
        where = ranks_on_hosts(unread, hosts_of(answers, unread))
        raise CheckpointError(f"not every rank can read the resume checkpoint ({where}: {answers[unread[0]][0]}): "
                              f"every node needs the same checkpoint at {path}")
    other = [rank for rank, (_, which_there, _) in enumerate(answers) if which_there != answers[0][1]]
    if other:
        raise CheckpointError(f"the resume checkpoint {path} is another one on "
                              f"{ranks_on_hosts(other, hosts_of(answers, other))} ({answers[other[0]][1]}) than on "
                              f"rank 0 on host {answers[0][2]} ({answers[0][1]}): every node needs the same "
                              "checkpoint at that path")
    return saved


def hosts_of(answers: list, ranks: list[int]) -> list[str]:
    """The hosts (each answer's last item) of `ranks`."""
    return [answers[rank][-1] for rank in ranks]


def sees(path: str, content: str) -> bool:
    """Whether `path` can be read here and holds `content`."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read() == content
    except OSError:
        return False


def ranks_on_hosts(ranks: list[int], hosts: list[str]) -> str:
    """"ranks 2-3 and 5 on host b, rank 9 on host c": `ranks` (ascending) grouped by their `hosts`, in
    the order of their first rank, each group's runs of ranks as ranges; past `HOSTS_NAMED` hosts, counted."""
    groups: dict[str, list[int]] = {}
    for rank, host in zip(ranks, hosts):
        groups.setdefault(host, []).append(rank)
    named = []
    for host, its_ranks in list(groups.items())[:HOSTS_NAMED]:
        runs: list[list[int]] = []
        for rank in its_ranks:
            if runs and rank == runs[-1][-1] + 1:
                runs[-1].append(rank)
            else:
                runs.append([rank])
        spans = [f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs]
        listed = ", ".join(spans[:-1]) + " and " + spans[-1] if len(spans) > 1 else spans[0]
        named.append(f"{'ranks' if len(its_ranks) > 1 else 'rank'} {listed} on host {host}")
    others = len(groups) - len(named)
    return ", ".join(named) + (f" and ranks on {others} other host{'s' if others > 1 else ''}" if others else "")
