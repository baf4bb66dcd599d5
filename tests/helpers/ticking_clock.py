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

if __name__ == "__main__":
    from trainer.loop import loop
    from trainer.loop.save_clock import SaveClock

    tick = float(os.environ["MINISFT_TEST_TICK_S"]) * (1 if os.environ.get("RANK", "0") == "0" else 1000)
    readings = itertools.count()
    loop.SaveClock = functools.partial(SaveClock, clock=lambda: next(readings) * tick)

    import train_full_sft

    sys.exit(train_full_sft.main(sys.argv[1:]))
