"""Qwen3 / Qwen3-MoE directories in and out (trainer/weights/read.py, write.py): transformers' logits, fine-tuning."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from dataset import build_cache_and_open
from model import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.overfitted import script_in_process
from tests.helpers.tiny_weights import MOE, RUN, SHAPES, demo_slices, whole_file_batch
from tests.helpers.trainer_launch import REPO, assert_weights_equal, checkpoint_at, clean_env, final_weights, run_trainer
from tests.helpers.trainer_launch import run_trainer_in_process, together, train_losses
from trainer.errors import CheckpointError
from trainer.weights.inference import load_model_for_inference
from trainer.weights.read import build_config, clean_state_dict, load_into, read_weights
from trainer.weights.write import write_qwen3_dir

data = pytest.fixture(scope="module", name="data")(demo_slices)


def ours(path) -> MiniMindForCausalLM:
    weights = read_weights(str(path))
    model = MiniMindForCausalLM(build_config(weights))
    load_into(model, weights)
    return model.eval()


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


# The YaRN correction range of these settings (head_dim 16) runs past the last frequency: MiniMind's ramp and
# transformers' differ (model/rope.py, yarn_ramp).
FAR_YARN = {"factor": 4.0, "original_max_position_embeddings": 4096}


def test_a_qwen3_yarn_whose_ramp_is_not_miniminds_loads_and_exports_with_transformers_logits(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    rope = {"rope_type": "yarn", "rope_theta": 100.0, **FAR_YARN}
    reference = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, max_position_embeddings=64, rope_parameters=rope,
                                             initializer_range=0.3, **SHAPES)).eval()
    reference.save_pretrained(tmp_path / "dir")
    model, ids = ours(tmp_path / "dir"), torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.allclose(logits, reference(ids).logits, atol=1e-5, rtol=0)  # not with MiniMind's ramp
    assert model.config.rope_yarn == {**FAR_YARN, "type": "yarn", "ramp": "transformers"}
    write_qwen3_dir(model, str(tmp_path / "out"), torch.float32)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"] == rope
    with torch.no_grad():
        assert torch.allclose(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(ids).logits, logits,
                              atol=1e-5, rtol=0)


def test_a_minimind_yarn_ramp_that_transformers_computes_otherwise_has_no_qwen3_export(tmp_path, tokenizer, capsys):
    from scripts.export_hf import main
    from trainer.weights.write import write_model_dir

    model = MiniMindForCausalLM(MiniMindConfig(vocab_size=len(tokenizer), max_position_embeddings=64, **SHAPES,
                                               rope_theta=100.0, rope_scaling={**FAR_YARN, "type": "yarn"}))
    assert write_model_dir(model, tokenizer, str(tmp_path / "model"), torch.float32) == "remote-code"
    with pytest.raises(SystemExit) as done:
        main(["--model_path", str(tmp_path / "model"), "--out_dir", str(tmp_path / "out"), "--format", "qwen3"])
    assert done.value.code == 2
    assert capsys.readouterr().err == (
        "error: --format qwen3 cannot express this model: its YaRN ramp is MiniMind's (correction range clamped at "
        "head_dim/2 - 1), which for these settings differs from transformers' (clamped at head_dim - 1) (use --format "
        "remote-code)\n")


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
    result = run_trainer_in_process([*RUN, "--from_weight", str(qwen3_dirs["dense"]), "--data_path",
                                     str(data / "eight.jsonl"), "--batch_size", "8", "--max_steps", "1", "--save_dir",
                                     str(run)], check=True)
    assert f"weights: qwen3 model {qwen3_dirs['dense']}" in result.stdout
    assert f"tokenizer: {qwen3_dirs['dense']} (saved with the weights, 6400 tokens)" in result.stdout
    batch = whole_file_batch(data / "eight.jsonl", tokenizer)  # the one step's batch: the whole file
    with torch.no_grad():
        expected = qwen3_dirs["models"]["dense"](**batch).loss.item()
    assert train_losses(run)[1] == pytest.approx(expected, rel=1e-5)

    export = tmp_path / "export"
    done = script_in_process("export_hf.py", "--model_path", str(run), "--out_dir", str(export))
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
    together(lambda: run_trainer_in_process([*common, "--batch_size", "8", "--save_interval", "2", "--save_dir",
                                             str(tmp_path / "one")], check=True),
             lambda: run_trainer([*common, "--batch_size", "4", "--save_interval", "0", "--save_dir",
                                  str(tmp_path / "two")], nproc=2))
    run_trainer([*common, "--batch_size", "8", "--save_interval", "0", "--save_dir", str(tmp_path / "resumed"),
                 "--resume_from", checkpoint_at(tmp_path / "one", 2)])
    one = final_weights(tmp_path / "one")
    assert_weights_equal(final_weights(tmp_path / "two"), one, atol=1e-5)
    assert_weights_equal(final_weights(tmp_path / "resumed"), one)
    initial = clean_state_dict(qwen3_dirs["models"]["moe"].state_dict())
    assert not torch.allclose(one["model.layers.0.mlp.experts.0.up_proj.weight"],
                              initial["model.layers.0.mlp.experts.0.up_proj.weight"])
    assert torch.load(checkpoint_at(tmp_path / "one", 2), weights_only=True)["model_config"]["num_experts_per_tok"] == 2


def test_a_config_that_is_not_an_object_or_has_a_null_rope_theta_is_one_clear_error(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path / "qwen3"
    Qwen3ForCausalLM(Qwen3Config(vocab_size=64, **SHAPES)).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = None  # at the top level (transformers 4) and in rope_parameters (5)
    if config.get("rope_parameters"):
        config["rope_parameters"]["rope_theta"] = None
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"qwen3: rope_theta must be a positive number, got None$"):
        read_weights(str(folder))
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config.json: expected a JSON object, got list$"):
        read_weights(str(folder))


def test_the_model_covers_its_own_positions_or_max_seq_len_where_it_is_more(tmp_path, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.helpers.tiny_weights import setup

    for own, longest, expected in ((64, 128, 128), (512, 128, 512)):
        folder = tmp_path / str(own)
        config = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=own, **SHAPES)
        Qwen3ForCausalLM(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        config = setup(["--from_weight", str(folder), "--max_seq_len", str(longest)])
        assert config.max_position_embeddings == expected
