"""Model weights in every format, never resume state (that is trainer/checkpoint/): read.py (every
format --from_weight and inference read), write.py (publishing model/ and best/, the exports,
MiniMind's .pth), inference.py (a trained model and its tokenizer for chat, eval and export)."""
