"""Training building blocks used by train_full_sft.py: one module per step of the script."""
