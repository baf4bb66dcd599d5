"""Run train_full_sft.py in a process that believes it sees $MINISFT_TEST_FAKE_GPUS CUDA devices
(no GPU is touched: the launch checks that read the count run before any device is used)."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

if __name__ == "__main__":
    import torch

    count = int(os.environ["MINISFT_TEST_FAKE_GPUS"])
    torch.cuda.is_available = lambda: count > 0
    torch.cuda.device_count = lambda: count

    import train_full_sft

    sys.exit(train_full_sft.main(sys.argv[1:]))
