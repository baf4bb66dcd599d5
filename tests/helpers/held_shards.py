"""Run train_full_sft.py with the shard writes of the sharded checkpoint of step 2 held until this
rank's training loop has taken step 4 (or 60 s have passed: a loop that waits for the write never
gets there). Each rank then prints "rank R: shards of step 2 written after step N"."""

import os
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

if __name__ == "__main__":
    from torch.distributed.checkpoint import FileSystemWriter

    from trainer.loop import loop

    taken, step_4 = [0], threading.Event()
    real_take_step, real_write = loop.take_step, FileSystemWriter.write_data

    def take_step(run, *args, **kwargs):
        result = real_take_step(run, *args, **kwargs)
        taken[0] = run.state.step
        if run.state.step >= 4:
            step_4.set()
        return result

    def write_data(self, plan, planner):
        if "step_00000002.dcp" in str(self.path):
            step_4.wait(timeout=60)
            print(f"rank {os.environ['RANK']}: shards of step 2 written after step {taken[0]}", flush=True)
        return real_write(self, plan, planner)

    loop.take_step = take_step
    FileSystemWriter.write_data = write_data

    import train_full_sft

    sys.exit(train_full_sft.main(sys.argv[1:]))
