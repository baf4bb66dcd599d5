"""Run train_full_sft.py with the clock of --save_every_minutes (trainer/loop/save_clock.py) replaced
by one that advances $MINISFT_TEST_TICK_S seconds at each reading (the first reads 0): rank 0 reads
it once at the start and once per optimizer step, so a time-based save falls on a known step.
Ranks other than 0 get a clock 1000 times faster: a decision taken on their clock would differ."""

import functools
import itertools
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def ticking_save_clock(tick_s: float):
    """A SaveClock class whose clock reads 0, tick_s, 2 * tick_s, ... (for trainer.loop.loop.SaveClock)."""
    from trainer.loop.save_clock import SaveClock

    readings = itertools.count()
    return functools.partial(SaveClock, clock=lambda: next(readings) * tick_s)


if __name__ == "__main__":
    from trainer.loop import loop

    tick = float(os.environ["MINISFT_TEST_TICK_S"]) * (1 if os.environ.get("RANK", "0") == "0" else 1000)
    loop.SaveClock = ticking_save_clock(tick)

    import train_full_sft

    sys.exit(train_full_sft.main(sys.argv[1:]))
