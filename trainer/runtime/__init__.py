"""The process a run lives in: the distributed group and device (distributed.py), the groups beside
it and the teardown of them all (groups.py), stop signals (preemption.py), per-rank seeds and RNG
state (seeding.py), the compute dtype, autocast and loss scaling (precision.py)."""
