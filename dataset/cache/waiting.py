"""What a process waiting for another one's token-cache build prints, and how often it looks.

Two waits for a build use it: a process that finds another live process building the same cache
(``resumable``: its first line at once, the lock holder is known) and a rank waiting for local rank
0's build or the other nodes' (``node``: its first line after ``WAIT_FIRST_S``, as reusing a cache
takes less); the trainer's ranks waiting for rank 0's checkpoint write use it too
(``trainer.runtime.distributed.rank0_value``). Each line names what it waits for and the seconds
waited, on stderr with every cache progress line; then one every ``WAIT_REPORT_S``. The constants
are read when a line is due, so a test that sets them here changes every wait.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from ..printable import print_escaped

WAIT_FIRST_S = 2.0  # a rank that has waited this long says what for (a reused cache is ready sooner)
WAIT_REPORT_S = 30.0  # how often a waiting process prints that it is still waiting
WAIT_POLL_S = 0.2  # how often a waiting process looks again, at most (`poll` looks sooner at first)


class WaitLines:
    """The lines of one wait: the first once ``first_s`` seconds have passed, then one every
    ``WAIT_REPORT_S``."""

    def __init__(self, first_s: float):
        self.start = time.monotonic()
        self.next_line = self.start + first_s

    def say_if_due(self, waiting: Callable[[], str]) -> None:
        """Print ``waiting()`` with the seconds waited if a line is due (``waiting`` is called only then)."""
        now = time.monotonic()
        if now >= self.next_line:
            self.next_line = now + WAIT_REPORT_S
            print_escaped(f"{waiting()} ({now - self.start:.0f} s)", file=sys.stderr)


def poll(done: Callable[[], bool], what: str) -> None:
    """Look until ``done()`` is true, saying that it waits for ``what`` once ``WAIT_FIRST_S`` have
    passed, then every ``WAIT_REPORT_S``. The first looks follow each other within milliseconds
    (an outcome that is nearly there costs no full ``WAIT_POLL_S``), then one every ``WAIT_POLL_S``."""
    lines, pause = WaitLines(first_s=WAIT_FIRST_S), 0.001
    while not done():
        time.sleep(pause)
        pause = min(2 * pause, WAIT_POLL_S)
        lines.say_if_due(lambda: what)
