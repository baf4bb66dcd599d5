"""Steps 6-8: the optimizer-step loop (loop.py) over the run and its resume state (state.py), with the
learning-rate schedule (lr_schedule.py) and per-source losses of a mixture (source_losses.py)."""
