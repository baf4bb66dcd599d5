"""Weights in and out (trainer/weights/read.py and write.py): Qwen3 / Qwen3-MoE directories built with transformers'
own classes, MiniMind `.pth` state dicts, the standard-format export, and the refusals."""

import fcntl
import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from dataset import SFTCollator, build_cache_and_open, load_tokenizer
from model import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.trainer_launch import REPO, SCRIPT, assert_weights_equal, checkpoint_at, clean_env, final_weights, run_trainer
from tests.helpers.trainer_launch import train_losses
from trainer.args import parse_args
from trainer.errors import CheckpointError
from trainer.weights.inference import load_model_for_inference
from trainer.errors import ConfigError
from trainer.model_setup import build_model_config, load_tokenizer_for_weights, read_initial_weights
from trainer.weights.read import build_config, clean_state_dict, load_into, read_weights
from trainer.weights.write import write_qwen3_dir

# head_dim 16 != hidden 32 / 4 heads, as in Qwen3
SHAPES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16)
MOE = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
RUN = ["--max_seq_len", "128", "--dtype", "float32", "--log_interval", "1", "--learning_rate", "3e-3",
       "--warmup_steps", "10", "--save_dtype", "float32"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory, tokenizer):
    """A tied dense Qwen3 (sharded, with tokenizer) and an untied Qwen3-MoE (no aux loss, with tokenizer)."""
    root = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), tie_word_embeddings=True, **SHAPES))
    dense.save_pretrained(root / "dense", max_shard_size="200KB")
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=len(tokenizer), tie_word_embeddings=False,
                                             router_aux_loss_coef=0.0, norm_topk_prob=False, **SHAPES, **MOE))
    moe.save_pretrained(root / "moe")
    for name in ("dense", "moe"):
        tokenizer.save_pretrained(root / name)
    assert os.path.isfile(root / "dense" / "model.safetensors.index.json")
    return {"dense": root / "dense", "moe": root / "moe", "models": {"dense": dense.eval(), "moe": moe.eval()}}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("weights_data")
    lines = open(os.path.join(REPO, "dataset", "demo", "sft_train.jsonl"), encoding="utf-8").readlines()
    (folder / "train.jsonl").write_text("".join(lines[:32]), encoding="utf-8")
    (folder / "eight.jsonl").write_text("".join(lines[:8]), encoding="utf-8")
    return folder


def whole_file_batch(path, tokenizer) -> dict:
    dataset = build_cache_and_open(path, tokenizer, 128)
    return SFTCollator(pad_token_id=tokenizer.pad_token_id)([dataset[i] for i in range(len(dataset))])


def ours(path) -> MiniMindForCausalLM:
    weights = read_weights(str(path))
    model = MiniMindForCausalLM(build_config(weights))
    load_into(model, weights)
    return model.eval()


# --------------------------------------------------------------------------- reading, in process


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_qwen3_directories_load_with_transformers_logits_and_write_back(qwen3_dirs, kind, tmp_path):
    from transformers import AutoModelForCausalLM

    model, reference = ours(qwen3_dirs[kind]), qwen3_dirs["models"][kind]
    assert (model.config.head_dim, model.config.rms_norm_eps, model.config.rope_theta) == (16, 1e-6, 10000.0)
    ids = torch.randint(0, 6400, (2, 24))
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.allclose(logits, reference(ids).logits, atol=1e-5, rtol=0)
    write_qwen3_dir(model, str(tmp_path / "out"), torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == ("qwen3_moe" if kind == "moe" else "qwen3") and "auto_map" not in config
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(reference)
    with torch.no_grad():
        assert torch.allclose(again(ids).logits, logits, atol=1e-5, rtol=0)


def test_yarn_rope_and_fused_in_memory_expert_tensors_map_exactly(tmp_path):
    """transformers keeps experts fused in memory (gate_up_proj [E, 2I, H]); such a state dict is split."""
    torch.manual_seed(1)
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}
    reference = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, max_position_embeddings=64, rope_parameters=yarn,
                                                   **SHAPES, **MOE)).eval()
    assert "model.layers.0.mlp.experts.gate_up_proj" in reference.state_dict()
    torch.save(reference.state_dict(), tmp_path / "fused.pth")
    shapes = read_weights(str(tmp_path / "fused.pth"))  # a .pth: architecture from the shapes
    assert shapes.config == dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, head_dim=16, num_attention_heads=4,
                                 num_key_value_heads=2, tie_word_embeddings=False, use_moe=True, num_experts=4,
                                 moe_intermediate_size=16)
    reference.save_pretrained(tmp_path / "dir")
    model = ours(tmp_path / "dir")
    assert model.config.rope_yarn == {"factor": 4.0, "original_max_position_embeddings": 16, "type": "yarn"}
    loaded = MiniMindForCausalLM(model.config)
    load_into(loaded, type(shapes)(clean_state_dict(reference.state_dict()), {}, "fused"))
    ids = torch.randint(0, 64, (2, 40))  # longer than the original context: YaRN is active
    with torch.no_grad():
        expected = reference(ids).logits
        assert torch.allclose(model(ids).logits, expected, atol=1e-5, rtol=0)
        assert torch.allclose(loaded.eval()(ids).logits, expected, atol=1e-5, rtol=0)


def test_unsupported_qwen3_settings_are_refused_with_the_reason(tmp_path):
    config = Qwen3MoeConfig(vocab_size=64, mlp_only_layers=[1], **SHAPES, **MOE)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "mixed")
    with pytest.raises(CheckpointError, match="some layers are dense .*cannot express it"):
        read_weights(str(tmp_path / "mixed"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "other" / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="model_type 'llama' is not supported"):
        read_weights(str(tmp_path / "other"))


def test_a_config_without_a_qwen3_form_is_saved_with_remote_code_and_refused_by_the_qwen3_export(tmp_path):
    from trainer.weights.write import qwen3_unsupported, write_inference_dir

    yarn = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16, "mscale": 0.7}
    model = MiniMindForCausalLM(MiniMindConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, rope_scaling=yarn))
    assert qwen3_unsupported(model.config) == "rope_scaling has settings transformers' YaRN does not read: ['mscale']"
    assert write_inference_dir(model, str(tmp_path / "model"), torch.float32) == "remote-code"
    assert json.loads((tmp_path / "model" / "config.json").read_text())["model_type"] == "minimind"
    assert write_inference_dir(MiniMindForCausalLM(MiniMindConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1)),
                               str(tmp_path / "plain"), torch.float32) == "qwen3"


# --------------------------------------------------------------------------- flags and tokenizer


def setup(argv):
    args = parse_args(argv)
    weights = read_initial_weights(args, log=lambda message: None)
    tokenizer, _ = load_tokenizer_for_weights(args, weights, log=lambda message: None)
    return build_model_config(args, tokenizer, weights)


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


def test_minimind_name_resolves_in_save_dir_and_moe_shapes_give_the_config(tmp_path):
    torch.manual_seed(3)
    moe = MiniMindForCausalLM(MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                             num_key_value_heads=2, use_moe=True, num_experts=3,
                                             moe_intermediate_size=24))
    torch.save({k: v.bfloat16() for k, v in moe.state_dict().items()}, tmp_path / "pretrain_32_moe.pth")
    argv = ["--from_weight", "pretrain", "--save_dir", str(tmp_path), "--hidden_size", "32", "--use_moe", "1"]
    config = setup([*argv, "--num_experts_per_tok", "2", "--aux_loss_coef", "0.01"])
    assert (config.num_hidden_layers, config.num_experts, config.moe_intermediate_size) == (1, 3, 24)
    assert (config.num_experts_per_tok, config.router_aux_loss_coef, config.rms_norm_eps) == (2, 0.01, 1e-6)
    assert config.tie_word_embeddings  # lm_head.weight present and equal to the embedding
    with pytest.raises(CheckpointError, match=f"--from_weight sft: neither a path nor MiniMind's {tmp_path}/sft_32.pth"):
        setup(["--from_weight", "sft", "--save_dir", str(tmp_path), "--hidden_size", "32"])


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



class RunsCode:
    """Unpickling this creates a marker file (a real malicious pickle, as in tests/e2e/test_fault_tolerance.py)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_only_a_pickle_is_called_malicious_and_other_files_are_told_what_weights_are(tmp_path, qwen3_dirs):
    from trainer.errors import ModelLoadError

    accepted = ("weights are a MiniMind .pth or a state dict .pt, a resume checkpoint (checkpoints/step_*.pt or a "
                "sharded step_*.dcp/), a .safetensors file, an HF model directory (config.json + model.safetensors) "
                "or a training run's directory")
    config = qwen3_dirs["dense"] / "config.json"
    (tmp_path / "notes.txt").write_text("not weights\n" * 50)
    (tmp_path / "empty.json").write_bytes(b"")
    (tmp_path / "empty.pt").write_bytes(b"")
    marker = tmp_path / "PWNED"
    torch.save({"format": "minisft-resume", "format_version": 1, "payload": RunsCode(marker)}, tmp_path / "evil.pt")
    shutil.copy(tmp_path / "evil.pt", tmp_path / "evil.json")  # the content decides, not the name
    malicious = "it contains Python objects that a safe (weights_only) load does not allow; it is not a minisft " \
                "checkpoint and may be malicious"
    expected = {
        config: f"{config} is a JSON file, not model weights; {accepted}; for the model this config describes, give "
                f"its folder {qwen3_dirs['dense']}",
        tmp_path / "notes.txt": f"{tmp_path / 'notes.txt'} is a text file, not model weights; {accepted}",
        tmp_path / "empty.json": f"{tmp_path / 'empty.json'} is a JSON file, not model weights; {accepted}",
        tmp_path / "empty.pt": f"{tmp_path / 'empty.pt'} is empty",
        tmp_path / "evil.pt": f"refused to load {tmp_path / 'evil.pt'}: {malicious}",
        tmp_path / "evil.json": f"refused to load {tmp_path / 'evil.json'}: {malicious}",
    }
    for path, message in expected.items():
        with pytest.raises(CheckpointError) as caught:  # --from_weight
            setup(["--from_weight", str(path)])
        assert str(caught.value) == message
        with pytest.raises(ModelLoadError) as caught:  # --model_path of chat, eval, export
            load_model_for_inference(path)
        assert str(caught.value) == message
    assert not marker.exists()
    done = subprocess.run([sys.executable, "train_full_sft.py", "--from_weight", str(config), "--save_dir",
                           str(tmp_path / "run")], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and done.stderr == f"error: {expected[config]}\n"


# --------------------------------------------------------------------------- end to end


FRESH_LOAD = textwrap.dedent("""
    import sys, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    assert "trainer" not in sys.modules and not any(p.rstrip("/") == sys.argv[3] for p in sys.path)
    result = {}
    for folder in sys.argv[1].split(","):
        model = AutoModelForCausalLM.from_pretrained(folder).eval()  # no trust_remote_code
        tokenizer = AutoTokenizer.from_pretrained(folder)
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Sum of 2 and 3?"}], tokenize=False,
                                             add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            result[folder] = {"ids": ids, "logits": model(ids).logits, "class": type(model).__name__,
                              "template": tokenizer.chat_template}
    torch.save(result, sys.argv[2])
""")


@pytest.mark.slow
def test_qwen3_fine_tune_first_loss_equals_transformers_and_exports_without_remote_code(qwen3_dirs, data, tmp_path,
                                                                                       tokenizer):
    run = tmp_path / "run"
    result = run_trainer([*RUN, "--from_weight", str(qwen3_dirs["dense"]), "--data_path", str(data / "eight.jsonl"),
                          "--batch_size", "8", "--max_steps", "1", "--save_dir", str(run)])
    assert f"weights: qwen3 model {qwen3_dirs['dense']}" in result.stdout
    assert f"tokenizer: {qwen3_dirs['dense']} (saved with the weights, 6400 tokens)" in result.stdout
    batch = whole_file_batch(data / "eight.jsonl", tokenizer)  # the one step's batch: the whole file
    with torch.no_grad():
        expected = qwen3_dirs["models"]["dense"](**batch).loss.item()
    assert train_losses(run)[1] == pytest.approx(expected, rel=1e-5)

    export = tmp_path / "export"
    done = subprocess.run([sys.executable, "scripts/export_hf.py", "--model_path", str(run), "--out_dir", str(export)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (tmp_path / "load.py").write_text(FRESH_LOAD)
    env = {k: v for k, v in clean_env().items() if k != "PYTHONPATH"}
    fresh = subprocess.run([sys.executable, "load.py", f"{run / 'model'},{export}", "fresh.pt", REPO], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr
    loaded = torch.load(tmp_path / "fresh.pt", weights_only=True)
    trained = load_model_for_inference(run)
    for folder in (run / "model", export):
        item = loaded[str(folder)]
        assert item["class"] == "Qwen3ForCausalLM" and item["template"] == tokenizer.chat_template
        with torch.no_grad():
            assert torch.allclose(item["logits"], trained(item["ids"]).logits, atol=1e-5, rtol=0)
    with torch.no_grad():  # training moved the weights: the equality above is not trivial
        assert not torch.allclose(qwen3_dirs["models"]["dense"](item["ids"]).logits, item["logits"], atol=1e-3)


@pytest.mark.slow
def test_qwen3_moe_two_ranks_equal_one_rank_and_resume_is_exact(qwen3_dirs, data, tmp_path, tokenizer):
    # 21 samples survive truncation to 128 tokens: the 3rd step ends the epoch with 5 of them, so on 2 ranks
    # one row of it only pads the epoch (dataset/epoch_padding.py; trained as a real sample it made this fail);
    # the 4th step starts the second epoch
    assert len(build_cache_and_open(data / "train.jsonl", tokenizer, 128)) == 21
    common = [*RUN, "--from_weight", str(qwen3_dirs["moe"]), "--data_path", str(data / "train.jsonl"),
              "--max_steps", "4"]
    run_trainer([*common, "--batch_size", "8", "--save_interval", "2", "--save_dir", str(tmp_path / "one")])
    run_trainer([*common, "--batch_size", "4", "--save_interval", "0", "--save_dir", str(tmp_path / "two")], nproc=2)
    run_trainer([*common, "--batch_size", "8", "--save_interval", "0", "--save_dir", str(tmp_path / "resumed"),
                 "--resume_from", checkpoint_at(tmp_path / "one", 2)])
    one = final_weights(tmp_path / "one")
    assert_weights_equal(final_weights(tmp_path / "two"), one, atol=1e-5)
    assert_weights_equal(final_weights(tmp_path / "resumed"), one)
    initial = clean_state_dict(qwen3_dirs["models"]["moe"].state_dict())
    assert not torch.allclose(one["model.layers.0.mlp.experts.0.up_proj.weight"],
                              initial["model.layers.0.mlp.experts.0.up_proj.weight"])
    assert torch.load(checkpoint_at(tmp_path / "one", 2), weights_only=True)["model_config"]["num_experts_per_tok"] == 2


@pytest.mark.slow
def test_minimind_fp16_pth_without_lm_head_round_trips(data, tmp_path, tokenizer):
    """MiniMind's `--from_weight pretrain` name, its fp16 state dict (tied head left out), and back."""
    torch.manual_seed(2)
    layout = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    pretrained = MiniMindForCausalLM(MiniMindConfig(**layout)).eval()  # MiniMind's defaults (eps 1e-6, tied)
    run = tmp_path / "out"
    run.mkdir()
    half = {k: v.half() for k, v in pretrained.state_dict().items() if k != "lm_head.weight"}
    torch.save(half, run / "pretrain_32.pth")
    result = run_trainer([*RUN, "--from_weight", "pretrain", "--hidden_size", "32", "--data_path",
                          str(data / "eight.jsonl"), "--batch_size", "8", "--max_steps", "1", "--save_dir", str(run),
                          "--save_weight", "sft"])
    assert f"weights: MiniMind state dict {run / 'pretrain_32.pth'}" in result.stdout
    start = MiniMindForCausalLM(MiniMindConfig(**layout)).eval()
    start.load_state_dict({**half, "lm_head.weight": half["model.embed_tokens.weight"]})
    with torch.no_grad():
        expected = start(**whole_file_batch(data / "eight.jsonl", tokenizer)).loss.item()
    assert train_losses(run)[1] == pytest.approx(expected, rel=1e-5)

    export = tmp_path / "minimind_out"
    done = subprocess.run([sys.executable, "scripts/export_hf.py", "--model_path", str(run), "--out_dir", str(export),
                           "--format", "minimind", "--save_weight", "full_sft"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "MiniMindConfig(hidden_size=32, num_hidden_layers=2, use_moe=False, num_attention_heads=4, " \
           "num_key_value_heads=2, head_dim=8)" in done.stdout
    state = torch.load(export / "full_sft_32.pth", weights_only=True)
    assert {v.dtype for v in state.values()} == {torch.float16} and "lm_head.weight" in state
    saved_by_trainer = torch.load(run / "sft_32.pth", weights_only=True)  # --save_weight sft
    assert_weights_equal(saved_by_trainer, state)
    minimind = MiniMindForCausalLM(MiniMindConfig(**layout, head_dim=8)).eval()
    minimind.load_state_dict(state, strict=True)
    trained = load_model_for_inference(run).half().float()  # the trained weights, in MiniMind's fp16
    ids = torch.randint(0, 6400, (2, 16))
    with torch.no_grad():
        assert torch.equal(minimind(ids).logits, trained(ids).logits)
        assert not torch.allclose(minimind(ids).logits, start(ids).logits, atol=1e-4)  # it did train


@pytest.mark.slow
def test_the_trainer_refuses_a_contradicting_flag_in_one_line(qwen3_dirs, data, tmp_path):
    result = run_trainer([*RUN, "--from_weight", str(qwen3_dirs["dense"]), "--num_key_value_heads", "4",
                          "--data_path", str(data / "eight.jsonl"), "--save_dir", str(tmp_path)], check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: flags contradict the --from_weight architecture (qwen3 model {qwen3_dirs['dense']}): "
        "--num_key_value_heads 4 but num_key_value_heads is 2; leave those flags out (the weights define the "
        "architecture)")


def test_export_refuses_a_format_that_cannot_express_the_model(qwen3_dirs, tmp_path, capsys):
    from scripts.export_hf import main

    with pytest.raises(SystemExit) as done:
        main(["--model_path", str(qwen3_dirs["moe"]), "--out_dir", str(tmp_path), "--format", "minimind"])
    assert done.value.code == 2
    assert capsys.readouterr().err == ("error: --format minimind cannot express this model: the LM head is not tied "
                                       "to the embedding (MiniMind always ties them) (use --format remote-code)\n")


# --------------------------------------------------------------------------- model/ and best/ on disk

# hidden 16: bf16 weights of ~210 kB, less than the tokenizer.json (405 kB) written after them
SMALL = ["--hidden_size", "16", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--num_key_value_heads", "1",
         "--max_seq_len", "128", "--dtype", "float32", "--log_interval", "1", "--learning_rate", "3e-3",
         "--warmup_steps", "0", "--batch_size", "4", "--eval_interval", "1", "--keep_best", "eval_loss"]
UMASK = 0o007  # neither the usual 022 nor 077: 0o660 is what a file created by open() gets


def small_run(data, save_dir, *extra):
    return [*SMALL, "--data_path", str(data / "train.jsonl"), "--eval_data_path", str(data / "eight.jsonl"),
            "--save_dir", str(save_dir), *extra]


@pytest.fixture(scope="module")
def kept_best_run(data, tmp_path_factory):
    """Two steps, each evaluated (best/ written at each), model/ saved at step 2; under UMASK."""
    run = tmp_path_factory.mktemp("kept_best") / "run"
    previous = os.umask(UMASK)
    try:
        run_trainer(small_run(data, run, "--max_steps", "2", "--save_interval", "2"))
    finally:
        os.umask(previous)
    assert json.loads((run / "best" / "best.json").read_text())["step"] == 2
    return run


@pytest.mark.slow
def test_model_best_and_exported_files_get_the_mode_of_the_umask(kept_best_run, tmp_path):
    """safetensors creates its file 0600: another user could not read a model meant to be shared."""
    export = tmp_path / "export"
    previous = os.umask(UMASK)
    try:
        done = subprocess.run([sys.executable, "scripts/export_hf.py", "--model_path", str(kept_best_run), "--out_dir",
                               str(export)], cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        os.umask(previous)
    assert done.returncode == 0, done.stderr
    for folder in (kept_best_run / "model", kept_best_run / "best", export):
        modes = {path.name: oct(path.stat().st_mode & 0o777) for path in folder.iterdir()}
        assert "model.safetensors" in modes and modes == {name: oct(0o666 & ~UMASK) for name in modes}, folder


@pytest.mark.slow
@pytest.mark.parametrize("limit,failing", [(300_000, "tokenizer.json"), (100_000, "model.safetensors")])
def test_a_full_disk_while_publishing_best_is_one_line_and_leaves_nothing_behind(kept_best_run, data, tmp_path,
                                                                                 limit, failing):
    """The resumed run's first evaluation is a new best; writing best/ hits the file size limit, in the
    weights or (tokenizers raises a bare Exception) in the tokenizer."""
    run = tmp_path / "run"
    shutil.copytree(kept_best_run, run)
    sizes = {name: os.path.getsize(run / "best" / name) for name in ("model.safetensors", "tokenizer.json")}
    assert sizes[failing] > limit and (failing == "model.safetensors" or sizes["model.safetensors"] < limit)
    published = {path: path.read_bytes() for name in ("model", "best") for path in (run / name).iterdir()}

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run([sys.executable, SCRIPT, *small_run(data, run, "--max_steps", "4", "--save_interval", "2",
                                                                "--from_resume", "1")],
                            cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300,
                            preexec_fn=limit_file_size)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        f"error: could not write inference weights to {run / 'best'}: File too large"]
    assert [path for path in run.rglob("*") if ".tmp." in path.name] == []
    assert {path: path.read_bytes() for name in ("model", "best") for path in (run / name).iterdir()} == published


@pytest.mark.slow
def test_a_full_disk_during_an_export_is_one_line_and_leaves_nothing_behind(kept_best_run, tmp_path):
    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))  # the weights fit, tokenizer.json does not

    out_dir = tmp_path / "export"
    out_dir.mkdir()
    (out_dir / "previous.txt").write_text("an earlier export")
    for fmt in ("qwen3", "minimind"):
        done = subprocess.run([sys.executable, "scripts/export_hf.py", "--model_path", str(kept_best_run / "model"),
                               "--out_dir", str(out_dir), "--overwrite", "--format", fmt, "--dtype", "bfloat16"],
                              cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.splitlines()[-1] == {
            "qwen3": f"error: could not write the export to {out_dir}: File too large (nothing was changed there)",
            "minimind": f"error: could not write {out_dir / 'full_sft_16.pth'}: File too large"}[fmt]
        assert sorted(path.name for path in tmp_path.iterdir()) == ["export"]
        assert sorted(path.name for path in out_dir.iterdir()) == ["previous.txt"]


# --------------------------------------------------------------------------- transformers 4.x reads the same


TF4_VENV = os.path.join(os.path.expanduser("~"), ".cache", "minisft-tf4-venv")  # built once, then reused
TF4_PACKAGES = ["transformers==4.57.*", "torch==2.13.0", "safetensors"]

TF4_RUN = textwrap.dedent("""
    import json, sys, torch, transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    assert "trainer" not in sys.modules
    texts, ids, result = json.loads(sys.argv[2]), json.loads(sys.argv[3]), {"version": transformers.__version__}
    for folder in sys.argv[1].split(","):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits
        result[folder] = {"logits": logits, "rope_theta": AutoConfig.from_pretrained(folder).rope_theta,
                          "tokenizer": type(tokenizer).__name__, "template": tokenizer.chat_template,
                          "ids": [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]}
    torch.save(result, "tf4.pt")
""")


def transformers4_python() -> str:
    """The python of a venv with transformers 4.57 (and torch, safetensors); skips the test when it cannot be built."""
    python = os.path.join(TF4_VENV, "bin", "python")
    ready = os.path.join(TF4_VENV, ".ready")
    os.makedirs(os.path.dirname(TF4_VENV), exist_ok=True)
    with open(TF4_VENV + ".lock", "w") as lock:  # another test process may be building it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(ready) and os.path.isfile(python):
            return python
        shutil.rmtree(TF4_VENV, ignore_errors=True)
        steps = ([sys.executable, "-m", "venv", TF4_VENV],
                 [python, "-m", "pip", "install", "--disable-pip-version-check", "-q", *TF4_PACKAGES])
        for step in steps:
            try:
                done = subprocess.run(step, capture_output=True, text=True, timeout=1200)
            except subprocess.TimeoutExpired:
                done = subprocess.CompletedProcess(step, 1, "", "timed out")
            if done.returncode != 0:
                shutil.rmtree(TF4_VENV, ignore_errors=True)
                reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
                pytest.skip(f"cannot build a venv with {' '.join(TF4_PACKAGES)} in {TF4_VENV} (no network or "
                            f"package index?): {reason}")
        open(ready, "w").close()
    return python


@pytest.mark.slow
def test_transformers_4_reads_the_exported_model_and_tokenizer_as_transformers_5_does(tmp_path, tokenizer):
    """transformers 4.57 (in its own venv) and 5 (here) give the same logits and token ids for model/ and the
    export: RoPE theta 1e6 (4.x fell back to 1e4 without a top-level rope_theta), YaRN, MoE; the tokenizer class
    (4.x has no TokenizersBackend)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trainer.weights.write import write_model_dir

    python = transformers4_python()
    torch.manual_seed(4)
    layout = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    models = {
        "dense": MiniMindConfig(**layout),
        "yarn": MiniMindConfig(**layout, rope_scaling={"type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 16}),
        "moe": MiniMindConfig(**layout, use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                              tie_word_embeddings=False),
    }
    for name, config in models.items():
        model = MiniMindForCausalLM(config)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0, 0.5)  # large enough that a wrong RoPE shows
        assert write_model_dir(model.eval(), tokenizer, str(tmp_path / name), torch.float32) == "qwen3"
    texts = [tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hello <|im_end|> world, 你好 123"}],
                                           tokenize=False, add_generation_prompt=True),
             "plain text with <|im_start|> and <tool_call> inside\n\n  spaces"]
    ids = list(range(100, 140))  # 40 positions: past YaRN's original 16
    (tmp_path / "tf4.py").write_text(TF4_RUN)
    env = {k: v for k, v in clean_env().items() if k != "PYTHONPATH"}
    done = subprocess.run([python, "tf4.py", ",".join(models), json.dumps(texts), json.dumps(ids)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    old = torch.load(tmp_path / "tf4.pt", weights_only=True)
    assert old["version"].startswith("4.57.")
    for name in models:
        folder = tmp_path / name
        assert old[name]["tokenizer"] == "PreTrainedTokenizerFast" and old[name]["rope_theta"] == 1e6
        new_tokenizer = AutoTokenizer.from_pretrained(folder)
        assert old[name]["ids"] == [new_tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        assert old[name]["ids"] == [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        assert old[name]["template"] == new_tokenizer.chat_template == tokenizer.chat_template
        with torch.no_grad():
            new = AutoModelForCausalLM.from_pretrained(folder).eval()(torch.tensor([ids])).logits
            ours = load_model_for_inference(folder)(torch.tensor([ids])).logits
        assert torch.allclose(old[name]["logits"], new, atol=1e-5, rtol=0), name
        assert torch.allclose(new, ours, atol=1e-5, rtol=0), name
