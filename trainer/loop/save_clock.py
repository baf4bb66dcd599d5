"""`--save_every_minutes`: saves by wall time beside the step-based `--save_interval`.

Rank 0's clock alone decides (the ranks' clocks differ, and a save is collective: every rank must
take it at the same step). Its "a save is due" rides in the sum of host values the ranks agree on
before every optimizer step (trainer/loop/loop.py `agree_on_step`), so deciding costs no collective
and no read of a device value. Granularity: one optimizer step. The step that starts at least
M minutes after the last save's decision is saved at its end; any save (by steps or by time)
starts the next M minutes.
"""

import time
from typing import Callable


class SaveClock:
    """When the next time-based save is due, on the clock `clock` (seconds)."""

    def __init__(self, minutes: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.seconds = minutes * 60
        self.clock = clock
        self.now = self.since = clock() if self.seconds > 0 else 0.0
        self.agreed = False  # what the ranks agreed on for the step just taken: save at its end

    def due(self) -> bool:
        """Whether M minutes have passed since the last save's decision (reads the clock, when M > 0)."""
        if self.seconds <= 0:
            return False
        self.now = self.clock()
        return self.now - self.since >= self.seconds

    def saved(self) -> None:
        """A save is taken at this step: the next is due M minutes after this step's decision."""
        self.since = self.now
        self.agreed = False
