"""SIGTERM (what schedulers send before preemption) and Ctrl-C (SIGINT) become a flag the loop
reads between steps: every rank then stops at the same step boundary, rank 0 writes a resume
checkpoint, and the process exits 0.

The handlers are installed before the script's slow imports (first thing in `main()` when it is
called from Python) and stay for the whole life of the process:
a SIGTERM before training (the run stops at its first step boundary, saving) or after it (during
the final save and shutdown, when nothing is left to lose) still ends with exit 0, not 143.
A second SIGINT means "stop now": one line, exit 130, no checkpoint of the unfinished step.
While Python finalizes, SIGTERM is ignored (`keep_exit_code`).
"""

import atexit
import os
import signal
import sys

EXIT_INTERRUPTED = 130  # the shell's code for "ended by SIGINT"


class PreemptionFlag:
    def __init__(self):
        self.requested = False
        self.reason = None  # "SIGTERM" or "SIGINT" once requested
        self.interrupted = False  # a SIGINT came (a second one stops now, whatever came first)

    def install(self) -> "PreemptionFlag":
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self.interrupted:
                say("error: interrupted again (Ctrl-C): stopped now, without saving the steps since the last checkpoint")
                os._exit(EXIT_INTERRUPTED)
            self.interrupted = True
        self.requested = True
        self.reason = self.reason or signal.Signals(signum).name
        if signum == signal.SIGINT:
            say("Ctrl-C: stopping at the next step boundary and saving (press Ctrl-C again to stop now)")


def keep_exit_code() -> None:
    """Ignore SIGTERM once Python starts finalizing this process (atexit): finalizing gives SIGTERM
    its default action back, and a SIGTERM then (torchrun stopping the other workers once one has
    exited, which happens while they leave with the same error line) would end the process by the
    signal, -15 in torchrun's report, instead of with the exit code it already has."""
    atexit.register(signal.signal, signal.SIGTERM, signal.SIG_IGN)


def say(line: str) -> None:
    """One line on stderr from a signal handler (os.write: print could re-enter a half-done print)."""
    os.write(sys.stderr.fileno(), (line + "\n").encode())


def forward_to(pids) -> None:
    """In a launcher process: pass SIGTERM and SIGINT on to `pids` (as SIGTERM, which every
    worker treats as "save and stop"; a Ctrl-C reaches the workers of the terminal's process
    group by itself, so forwarding it as SIGINT would count twice)."""

    def forward(signum, frame) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
