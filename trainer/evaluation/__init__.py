"""Held-out evaluation (evaluate.py: loss, token accuracy, generated answers and tool calls) and the
choice of checkpoint it drives (selection.py: --keep_best, early stopping)."""
