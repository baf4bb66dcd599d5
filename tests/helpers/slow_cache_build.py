"""Run train_full_sft.py with rank $MINISFT_TEST_SLOW_BUILD_RANK's token-cache build made
$MINISFT_TEST_SLOW_BUILD_S seconds longer (a slow node), and the waiting ranks' progress line
printed every second instead of every 30."""

import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

if __name__ == "__main__":
    from dataset.cache import node as node_build
    from dataset.cache import waiting

    original = node_build.build_or_reuse

    def slow_build(*args, **kwargs):
        if os.environ["RANK"] == os.environ["MINISFT_TEST_SLOW_BUILD_RANK"]:
            time.sleep(float(os.environ["MINISFT_TEST_SLOW_BUILD_S"]))
        return original(*args, **kwargs)

    node_build.build_or_reuse = slow_build
    waiting.WAIT_REPORT_S = 1.0

    import train_full_sft

    sys.exit(train_full_sft.main(sys.argv[1:]))
