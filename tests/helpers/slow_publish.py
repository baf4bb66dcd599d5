"""Run train_full_sft.py with rank 0's writes of `model/` made $MINISFT_TEST_SLOW_PUBLISH_S seconds
longer (a slow filesystem), and the waiting ranks' progress line printed every second instead of
every 30."""

import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

if __name__ == "__main__":
    from dataset.cache import waiting
    from trainer.loop import saves

    original = saves.publish_inference_weights

    def slow_publish(*args, **kwargs):
        time.sleep(float(os.environ["MINISFT_TEST_SLOW_PUBLISH_S"]))
        return original(*args, **kwargs)

    saves.publish_inference_weights = slow_publish
    waiting.WAIT_REPORT_S = 1.0

    import train_full_sft

    sys.exit(train_full_sft.main(sys.argv[1:]))
