"""--from_weight with the other flags (trainer/model_setup.py): the weights define the architecture and tokenizer."""

import json
import shutil

import pytest
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.helpers.tiny_weights import RUN, SHAPES, demo_slices, setup
from tests.helpers.trainer_launch import run_trainer_in_process
from trainer.args import parse_args
from trainer.errors import ConfigError
from trainer.model_setup import read_initial_weights

data = pytest.fixture(scope="module", name="data")(demo_slices)


def test_config_comes_from_the_weights_and_contradicting_flags_are_refused(qwen3_dirs):
    config = setup(["--from_weight", str(qwen3_dirs["moe"]), "--num_experts_per_tok", "2", "--hidden_size", "32"])
    assert (config.hidden_size, config.head_dim, config.num_experts_per_tok, config.norm_topk_prob) == (32, 16, 2, False)
    assert config.router_aux_loss_coef == 0.0 and config.tie_word_embeddings is False
    with pytest.raises(ConfigError) as error:
        setup(["--from_weight", str(qwen3_dirs["moe"]), "--hidden_size", "768", "--rms_norm_eps", "1e-5"])
    assert str(error.value) == (
        f"flags contradict the --from_weight architecture (qwen3_moe model {qwen3_dirs['moe']}): --hidden_size 768 but "
        "hidden_size is 32; --rms_norm_eps 1e-05 but rms_norm_eps is 1e-06; leave those flags out (the weights define "
        "the architecture)")
    with pytest.raises(ConfigError, match="--save_weight: this model has no MiniMind .pth form: the LM head is not tied"):
        setup(["--from_weight", str(qwen3_dirs["moe"]), "--save_weight", "full_sft"])


def test_a_tokenizer_that_does_not_match_the_weights_is_refused(qwen3_dirs, tmp_path, tokenizer):
    # same size, two ids swapped: another vocabulary
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    a, b = next(k for k in vocab if vocab[k] == 1000), next(k for k in vocab if vocab[k] == 1001)
    vocab[a], vocab[b] = vocab[b], vocab[a]
    shutil.copytree(qwen3_dirs["dense"], tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ConfigError, match="has another vocabulary than the tokenizer saved with the weights"):
        setup(["--from_weight", str(qwen3_dirs["dense"]), "--tokenizer_path", str(tmp_path / "tok")])
    # weights without a tokenizer, of another vocabulary size than the (shipped) tokenizer
    Qwen3ForCausalLM(Qwen3Config(vocab_size=64, **SHAPES)).save_pretrained(tmp_path / "small")
    with pytest.raises(ConfigError, match="the tokenizer has 6400 tokens but the weights' vocab_size is 64"):
        setup(["--from_weight", str(tmp_path / "small")])


def test_explicit_flags_and_bare_use_wandb():
    args = parse_args(["--use_wandb", "--hidden_size", "768"])
    assert args.use_wandb == 1 and args.explicit_flags == ("hidden_size", "use_wandb")
    assert parse_args(["--use_wandb", "1"]).use_wandb == 1 and parse_args([]).use_wandb == 0
    assert parse_args([]).explicit_flags == ()
    messages = []
    assert read_initial_weights(parse_args([]), messages.append) is None
    assert messages == ["weights: none, training from scratch"]


@pytest.mark.slow
def test_the_trainer_refuses_a_contradicting_flag_in_one_line(qwen3_dirs, data, tmp_path):
    result = run_trainer_in_process([*RUN, "--from_weight", str(qwen3_dirs["dense"]), "--num_key_value_heads", "4",
                                     "--data_path", str(data / "eight.jsonl"), "--save_dir", str(tmp_path)])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: flags contradict the --from_weight architecture (qwen3 model {qwen3_dirs['dense']}): "
        "--num_key_value_heads 4 but num_key_value_heads is 2; leave those flags out (the weights define the "
        "architecture)")
