"""Run train_full_sft.py and send this process a real SIGTERM at a chosen moment outside the
training loop, named by $MINISFT_TEST_SIGTERM_AT:

- `init`: just before step 1 (init distributed), long before the loop starts;
- `shutdown`: after training and the final save, just before step 9 (the clean shutdown).
"""

import os
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

if __name__ == "__main__":
    import train_full_sft

    step = {"init": "init_distributed", "shutdown": "cleanup"}[os.environ["MINISFT_TEST_SIGTERM_AT"]]
    original = getattr(train_full_sft, step)

    def signal_then_run(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    setattr(train_full_sft, step, signal_then_run)
    sys.exit(train_full_sft.main(sys.argv[1:]))
