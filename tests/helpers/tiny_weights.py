"""Shapes, training flags and helpers shared by the tests of trainer/weights/."""

import os

from dataset import SFTCollator, build_cache_and_open
from tests.helpers.trainer_launch import REPO
from trainer.args import parse_args
from trainer.model_setup import build_model_config, load_tokenizer_for_weights, read_initial_weights


# head_dim 16 != hidden 32 / 4 heads, as in Qwen3
SHAPES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16)
MOE = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
RUN = ["--max_seq_len", "128", "--dtype", "float32", "--log_interval", "1", "--learning_rate", "3e-3",
       "--warmup_steps", "10", "--save_dtype", "float32"]


def demo_slices(tmp_path_factory):
    """The demo set's first 32 conversations (train.jsonl) and first 8 (eight.jsonl); a test module makes it
    its `data` fixture (in place of tests/conftest.py's)."""
    folder = tmp_path_factory.mktemp("weights_data")
    lines = open(os.path.join(REPO, "dataset", "demo", "sft_train.jsonl"), encoding="utf-8").readlines()
    (folder / "train.jsonl").write_text("".join(lines[:32]), encoding="utf-8")
    (folder / "eight.jsonl").write_text("".join(lines[:8]), encoding="utf-8")
    return folder


def whole_file_batch(path, tokenizer) -> dict:
    """The file's conversations as one collated batch, as the trainer reads them at --max_seq_len 128."""
    dataset = build_cache_and_open(path, tokenizer, 128)
    return SFTCollator(pad_token_id=tokenizer.pad_token_id)([dataset[i] for i in range(len(dataset))])


def setup(argv):
    """The model config the trainer builds for these flags, with the weights and tokenizer they name."""
    args = parse_args(argv)
    weights = read_initial_weights(args, log=lambda message: None)
    tokenizer, _ = load_tokenizer_for_weights(args, weights, log=lambda message: None)
    return build_model_config(args, tokenizer, weights)
