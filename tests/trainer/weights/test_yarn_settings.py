"""YaRN settings, head sizes and what transformers refuses in a config read with the weights
(model/configuration_minimind.py, rope_problem; trainer/weights/read.py): the values transformers computes
with make its tables, the others are one line from the trainer naming the source, the key and the value."""

import json
import shutil

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from model import MiniMindConfig, MiniMindForCausalLM
from model.rope import precompute_rope_tables
from tests.helpers.tiny_weights import MOE, SHAPES
from tests.helpers.trainer_launch import flags, run_trainer_in_process
from trainer.checkpoint.single_file import stamped
from trainer.weights.read import build_config, config_from_qwen3, load_into, read_weights

YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("edge", [
    {"factor": 1.0},  # no stretch: plain RoPE's frequencies, attention factor 1
    {"beta_fast": 4.0, "beta_slow": 4.0},  # an empty correction range
    {"beta_fast": 1.0, "beta_slow": 32.0},  # beta_fast below beta_slow: transformers' ramp runs backwards
    {"beta_fast": 0.5, "beta_slow": 0.25},  # fewer than one rotation
    {"attention_factor": 0.25},
    {"attention_factor": 2},
    {"original_max_position_embeddings": 4096},  # a correction range past the last frequency
    {"factor": None},  # transformers' factor: max_position_embeddings / original_max_position_embeddings, 4
    {"factor": None, "original_max_position_embeddings": 32},  # 2
])
def test_yarn_settings_transformers_computes_with_make_its_tables(edge):
    reference = Qwen3Config(vocab_size=64, max_position_embeddings=64, rope_parameters={**YARN, **edge}, **SHAPES)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](reference, "cpu")
    angles = torch.outer(torch.arange(64, dtype=torch.float32), inv_freq).repeat(1, 2)
    cos, sin = precompute_rope_tables(MiniMindConfig(**config_from_qwen3(reference.to_dict(), "qwen3")))
    assert torch.allclose(cos, angles.cos() * attention_factor, rtol=0, atol=1e-6)
    assert torch.allclose(sin, angles.sin() * attention_factor, rtol=0, atol=1e-6)


@pytest.mark.parametrize("config, factor, original", [
    ({"rope_parameters": {**YARN, "factor": None}}, 4.0, 16),
    ({"rope_scaling": {"type": "yarn", "factor": None, "original_max_position_embeddings": 16}, "rope_theta": 100.0},
     4.0, 16),
    # transformers' RoPE takes a top-level original context over the one in the settings (Phi3's layout)
    ({"rope_parameters": {**YARN, "factor": None}, "original_max_position_embeddings": 8}, 8.0, 8),
    ({"rope_parameters": YARN, "original_max_position_embeddings": 8}, 4.0, 8),
    # no original context: transformers takes max_position_embeddings, so the factor is 1
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 100.0, "factor": None}}, 1.0, 64),
])
def test_a_null_yarn_factor_and_the_original_context_are_read_as_transformers_reads_them(qwen3_dir, tmp_path, config,
                                                                                         factor, original):
    """A null factor is max_position_embeddings / original_max_position_embeddings, as transformers computes it."""
    folder = changed_copy(qwen3_dir, tmp_path / "qwen3", **config)
    reference = Qwen3ForCausalLM.from_pretrained(folder).eval()
    weights = read_weights(str(folder))
    model = MiniMindForCausalLM(build_config(weights))
    load_into(model, weights)
    assert (model.config.rope_yarn["factor"], model.config.rope_yarn["original_max_position_embeddings"]) == (
        factor, original)
    ids = torch.randint(0, 64, (2, 48))  # past the original context: YaRN is active
    with torch.no_grad():
        assert torch.allclose(model.eval()(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("yarn") / "qwen3"
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=64, max_position_embeddings=64, **SHAPES)).save_pretrained(folder)
    return folder


def changed_copy(folder, target, **changes):
    """A copy of the model folder whose config.json has `changes`."""
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target


ZERO_BETA = "must be a positive number, got 0 (transformers reads 0 as its default, {0}: give {0} or leave it out)"


@pytest.mark.parametrize("rope, line", [
    ({"beta_fast": 0}, "rope_parameters['beta_fast'] " + ZERO_BETA.format(32)),
    ({"beta_slow": 0}, "rope_parameters['beta_slow'] " + ZERO_BETA.format(1)),
    ({"beta_slow": -1.0}, "rope_parameters['beta_slow'] must be a positive number, got -1.0"),
    ({"attention_factor": 0.0}, "rope_parameters['attention_factor'] must be a positive number, got 0.0 (it scales "
                                "the cos/sin tables: 0 makes them 0)"),
    ({"factor": 0.5}, "rope_parameters['factor'] must be a number >= 1 (the context's stretch), got 0.5"),
    ({"factor": None, "original_max_position_embeddings": 128}, "rope_parameters['factor'] is null, for which "
     "transformers computes max_position_embeddings / original_max_position_embeddings = 64 / 128 = 0.5: it must be "
     ">= 1 (the context's stretch)"),
    ({"factor": None, "original_max_position_embeddings": 0},  # transformers divides by zero
     "rope_parameters['original_max_position_embeddings'] must be a positive number, got 0"),
    ({"original_max_position_embeddings": 0},
     "rope_parameters['original_max_position_embeddings'] must be a positive number, got 0"),
    ({"rope_theta": 1.0}, "rope_parameters (YaRN) needs rope_theta other than 1: its correction range divides by "
                          "log(rope_theta)"),
])
def test_yarn_settings_that_cannot_work_are_one_line_naming_the_qwen3_folder(qwen3_dir, data, tmp_path, rope, line):
    folder = changed_copy(qwen3_dir, tmp_path / "qwen3", rope_parameters={**YARN, **rope})
    done = run_trainer_in_process(flags(data, tmp_path / "run", "--from_weight", str(folder)))
    assert (done.returncode, done.stderr.splitlines()) == (2, [f"error: {folder}: {line}"])


def test_yarn_settings_without_a_factor_are_one_line_as_transformers_refuses_them(qwen3_dir, data, tmp_path):
    rope = {key: value for key, value in YARN.items() if key != "factor"}
    folder = changed_copy(qwen3_dir, tmp_path / "qwen3", rope_parameters=rope)
    done = run_trainer_in_process(flags(data, tmp_path / "run", "--from_weight", str(folder)))
    assert (done.returncode, done.stderr.splitlines()) == (
        2, [f"error: {folder}: rope_parameters has no factor (the context's stretch)"])


def test_yarn_settings_saved_with_minisft_weights_are_checked_alike(data, tmp_path):
    """A minisft model folder and a resume checkpoint keep the settings as `rope_yarn`."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(vocab_size=6400, hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2))
    model.save_pretrained(tmp_path / "model")
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "rope_yarn": {**yarn, "beta_fast": 0}}))
    checkpoint = tmp_path / "step_00000001.pt"
    torch.save(stamped({"model": model.state_dict(), "model_config": {**model.config.to_dict(), "rope_yarn": {
        "type": "yarn", "factor": 4.0}}}), checkpoint)
    for source, line in (
            (f"minisft model {tmp_path / 'model'}", "rope_yarn['beta_fast'] " + ZERO_BETA.format(32)),
            (f"resume checkpoint {checkpoint}", "rope_yarn has no original_max_position_embeddings (the context the "
                                                "model was trained for)")):
        done = run_trainer_in_process(flags(data, tmp_path / "run", "--from_weight", source.split()[-1]))
        assert (done.returncode, done.stderr.splitlines()) == (
            2, [f"error: {source}: invalid model config (MiniMindConfig: {line})"])


def test_head_sizes_of_a_qwen3_config_are_read_as_transformers_reads_them(qwen3_dir, data, tmp_path):
    """head_dim 0 is refused (not taken for hidden_size / heads); a Qwen3-MoE config without head_dim has
    hidden_size / heads, and an impossible initializer_range is refused before a model is built."""
    for changes, line in (({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
                          ({"initializer_range": -1.0}, "initializer_range must be a number >= 0, got -1.0")):
        folder = changed_copy(qwen3_dir, tmp_path / next(iter(changes)), **changes)
        done = run_trainer_in_process(flags(data, tmp_path / "run", "--from_weight", str(folder)))
        assert (done.returncode, done.stderr.splitlines()) == (
            2, [f"error: {folder}: invalid model config (MiniMindConfig: {line})"])
    torch.manual_seed(1)
    shapes = {key: value for key, value in SHAPES.items() if key != "head_dim"}
    reference = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, **shapes, **MOE)).eval()
    reference.save_pretrained(tmp_path / "moe")
    assert "head_dim" not in json.loads((tmp_path / "moe" / "config.json").read_text())
    weights = read_weights(str(tmp_path / "moe"))
    model = MiniMindForCausalLM(build_config(weights))
    load_into(model, weights)
    assert model.config.head_dim == 8
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert torch.allclose(model.eval()(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)


def test_a_qwen3_config_transformers_refuses_is_one_line_with_its_reason(qwen3_dir, data, tmp_path):
    """transformers' validation errors put their reason on a second line (dataset/formats.py, first_line)."""
    for changes, reason in (
            ({"rms_norm_eps": 0}, "Validation error for field 'rms_norm_eps': TypeError: Field 'rms_norm_eps' expected "
                                  "float, got int (value: 0)"),
            ({"head_dim": 7}, "Class validation error for validator 'validate_rope': ValueError: RoPE requires an even "
                              "rotary dimension, but got `head_dim`=7 with `partial_rotary_factor`=1.0 for "
                              "`full_attention`.")):
        folder = changed_copy(qwen3_dir, tmp_path / next(iter(changes)), **changes)
        done = run_trainer_in_process(flags(data, tmp_path / "run", "--from_weight", str(folder)))
        lines = {f"error: {folder}: invalid qwen3 config ({reason})"}
        if "head_dim" in changes:  # a transformers that does not check the rotary dimension (5.17): ours does
            lines.add(f"error: {folder}: invalid model config (MiniMindConfig: head_dim must be even for RoPE, got 7)")
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and done.stderr.strip() in lines, done.stderr


def test_a_switch_given_as_text_is_one_line_from_every_config_read_with_the_weights(qwen3_dir, data, tmp_path):
    """"false" is truthy: in a minisft model folder or a resume checkpoint it would mean True. transformers'
    Qwen3 config refuses it (and 0 and 1) in a line of its own."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(vocab_size=6400, hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2))
    model.save_pretrained(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": "false"}))
    checkpoint = tmp_path / "step_00000001.pt"
    torch.save(stamped({"model": model.state_dict(), "model_config": {**model.config.to_dict(), "use_moe": 0}}),
               checkpoint)
    qwen3 = changed_copy(qwen3_dir, tmp_path / "qwen3", tie_word_embeddings="false")
    invalid = "invalid model config (MiniMindConfig: {} must be true or false (a JSON bool), got {})"
    for source, line in (
            (f"minisft model {tmp_path / 'model'}", invalid.format("tie_word_embeddings", "'false'")),
            (f"resume checkpoint {checkpoint}", invalid.format("use_moe", 0)),
            (str(qwen3), "invalid qwen3 config (Validation error for field 'tie_word_embeddings': TypeError: Field "
                         "'tie_word_embeddings' expected bool, got str (value: 'false'))")):
        done = run_trainer_in_process(flags(data, tmp_path / "run", "--from_weight", source.split()[-1]))
        assert (done.returncode, done.stderr.splitlines()) == (2, [f"error: {source}: {line}"])
