"""Run train_full_sft.py with the shard writes of the sharded checkpoint of step 2 held until this
rank's training loop has taken step $MINISFT_TEST_RELEASE_AT (default 4), or 60 s have passed (a
loop that waits for the write never gets there). Each rank then prints "rank R: shards of step 2
written after step N". With $MINISFT_TEST_SIGTERM_AT set, rank 1 sends itself a SIGTERM once its
loop has taken that step."""

import os
import signal
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

if __name__ == "__main__":
    from torch.distributed.checkpoint import FileSystemWriter

    from trainer.loop import loop

    release_at, sigterm_at = int(os.environ.get("MINISFT_TEST_RELEASE_AT", "4")), os.environ.get("MINISFT_TEST_SIGTERM_AT")
    taken, released = [0], threading.Event()
    real_take_step, real_write = loop.take_step, FileSystemWriter.write_data

    def take_step(run, *args, **kwargs):
        result = real_take_step(run, *args, **kwargs)
        taken[0] = run.state.step
        if run.state.step >= release_at:
            released.set()
        if sigterm_at and run.state.step == int(sigterm_at) and os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    def write_data(self, plan, planner):
        if "step_00000002.dcp" in str(self.path):
            released.wait(timeout=60)
            print(f"rank {os.environ['RANK']}: shards of step 2 written after step {taken[0]}", flush=True)
        return real_write(self, plan, planner)

    loop.take_step = take_step
    FileSystemWriter.write_data = write_data

    import train_full_sft

    sys.exit(train_full_sft.main(sys.argv[1:]))
