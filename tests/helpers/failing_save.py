"""Run train_full_sft.py with the publishing of `model/` failing from the $MINISFT_TEST_FAIL_SAVE_AT-th
save on (rank 0 writes it), as a full disk would make it fail in the writer thread."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

if __name__ == "__main__":
    from trainer.errors import CheckpointError
    from trainer.loop import saves

    original, calls = saves.publish_inference_weights, []

    def failing_publish(model, tokenizer, save_dir, dtype):
        calls.append(1)
        if len(calls) >= int(os.environ["MINISFT_TEST_FAIL_SAVE_AT"]):
            raise CheckpointError(f"could not write inference weights to {save_dir}/model: No space left on device")
        return original(model, tokenizer, save_dir, dtype)

    saves.publish_inference_weights = failing_publish

    import train_full_sft

    sys.exit(train_full_sft.main(sys.argv[1:]))
