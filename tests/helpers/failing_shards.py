"""Run train_full_sft.py with rank $MINISFT_TEST_FAIL_RANK's shard writes failing, as a full disk
makes them fail, from the $MINISFT_TEST_FAIL_SAVE_AT-th sharded save on (--fsdp 1)."""

import errno
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

if __name__ == "__main__":
    from torch.distributed.checkpoint import FileSystemWriter

    real_write, calls = FileSystemWriter.write_data, []

    def write_data(self, plan, planner):
        calls.append(1)
        if (os.environ["RANK"] == os.environ["MINISFT_TEST_FAIL_RANK"]
                and len(calls) >= int(os.environ["MINISFT_TEST_FAIL_SAVE_AT"])):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, plan, planner)

    FileSystemWriter.write_data = write_data

    import train_full_sft

    sys.exit(train_full_sft.main(sys.argv[1:]))
