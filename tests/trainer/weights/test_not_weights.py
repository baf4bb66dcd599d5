"""Files that are not weights (trainer/weights/read.py): each is told what weights are; only a pickle is malicious."""

import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers.malicious_pickle import RunsCode
from tests.helpers.tiny_weights import setup
from tests.helpers.trainer_launch import REPO, clean_env
from trainer.errors import CheckpointError
from trainer.weights.inference import load_model_for_inference


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


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_holding_a_non_finite_value_are_refused_when_read(tmp_path, bad):
    from model import MiniMindConfig, MiniMindForCausalLM
    from trainer.errors import ModelLoadError

    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=64))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.layers.1.mlp.down_proj.weight"][3, 5] = bad
    torch.save(state, tmp_path / "pretrain_32.pth")
    path = tmp_path / "pretrain_32.pth"
    message = (f"MiniMind state dict {path} holds non-finite values (NaN or inf) in 1 tensor "
               "(model.layers.1.mlp.down_proj.weight): these weights cannot be trained, evaluated or exported")
    with pytest.raises(CheckpointError) as caught:  # --from_weight: before any data is tokenized
        setup(["--from_weight", str(path), "--save_dir", str(tmp_path)])
    assert str(caught.value) == message
    with pytest.raises(ModelLoadError) as caught:  # --model_path of chat, eval, export
        load_model_for_inference(path)
    assert str(caught.value) == message


def test_float8_weights_are_refused_when_read_not_cast_without_their_scales(tmp_path):
    from safetensors.torch import save_file

    from trainer.errors import ModelLoadError

    from model import MiniMindConfig, MiniMindForCausalLM

    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].to(torch.float8_e4m3fn)
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    message = (f"{path} holds float8 (quantized) weights in 1 tensor (model.embed_tokens.weight): minisft reads "
               "float32, bfloat16 or float16 weights; give the unquantized model")
    with pytest.raises(CheckpointError) as caught:
        setup(["--from_weight", str(path), "--save_dir", str(tmp_path)])
    assert str(caught.value) == message
    with pytest.raises(ModelLoadError) as caught:
        load_model_for_inference(path)
    assert str(caught.value) == message
