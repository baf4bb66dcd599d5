"""SIGTERM (what schedulers send before preemption) becomes a flag the loop reads between steps:
every rank then stops at the same step boundary, rank 0 writes a resume checkpoint, and the
process exits 0."""

import signal


class PreemptionFlag:
    def __init__(self):
        self.requested = False
        self._previous = None

    def install(self) -> "PreemptionFlag":
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
