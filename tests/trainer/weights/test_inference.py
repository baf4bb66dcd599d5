"""trainer/weights/inference.py: every kind of model path loads the same weights and tokenizer; bad files are refused."""

from pathlib import Path

import pytest
import torch

from trainer.errors import CheckpointError, ModelLoadError
from trainer.weights.inference import load_model_for_inference, load_tokenizer_for_model


@pytest.mark.parametrize("kind", ["run_dir", "hf_dir", "checkpoint", "safetensors"])
def test_every_path_kind_loads_the_same_weights(trained, kind):
    loaded = load_model_for_inference(trained[kind])
    assert not loaded.training
    expected = trained["model"].state_dict()
    state = loaded.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert load_tokenizer_for_model(trained[kind]).chat_template == trained["tokenizer"].chat_template


def test_tokenizer_comes_from_the_checkpoint_args(trained, tmp_path):
    tokenizer_dir = tmp_path / "tok"
    trained["tokenizer"].save_pretrained(tokenizer_dir)
    state = torch.load(trained["checkpoint"], weights_only=True)
    state["args"]["tokenizer_path"] = str(tokenizer_dir)
    torch.save(state, tmp_path / "step.pt")
    assert Path(load_tokenizer_for_model(tmp_path / "step.pt").name_or_path) == tokenizer_dir
    assert Path(load_tokenizer_for_model(trained["hf_dir"]).name_or_path) == trained["hf_dir"]


class Malicious:
    marker = None

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_bad_files_raise_one_line_model_load_errors(trained, tmp_path):
    good = trained["checkpoint"].read_bytes()
    (tmp_path / "truncated.pt").write_bytes(good[: len(good) // 2])
    (tmp_path / "zeros.pt").write_bytes(bytes(4096))
    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    marker = tmp_path / "PWNED"
    Malicious.marker = str(marker)
    torch.save({"format": "minisft-resume", "model": Malicious()}, tmp_path / "evil.pt")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 100)
    (tmp_path / "config.json").write_text((trained["hf_dir"] / "config.json").read_text())
    cases = {
        "missing.pt": "does not exist",
        "truncated.pt": "corrupt or truncated",
        "zeros.pt": "corrupt or truncated",
        "empty.pt": "empty",
        "other.pt": "not a minisft resume checkpoint",
        "evil.pt": "refused to load",
        "bad.safetensors": "corrupt or truncated safetensors",
    }
    for name, message in cases.items():
        with pytest.raises(ModelLoadError, match=message) as info:
            load_model_for_inference(tmp_path / name)
        assert "\n" not in str(info.value) and name in str(info.value)
    assert not marker.exists()
    with pytest.raises(ModelLoadError, match="refused to load"):
        load_tokenizer_for_model(tmp_path / "evil.pt")
    assert not marker.exists()


def test_a_runs_checkpoints_folder_names_what_to_give_instead(trained):
    # not "not a model directory (no config.json), nor a run directory": the same line for the loader and --from_weight
    from trainer.weights.read import read_weights

    folder = trained["checkpoint"].parent
    line = (f"{folder} is a run's folder of resume checkpoints: give one of them ({trained['checkpoint'].name}) "
            f"or the run's directory {folder.parent}")
    with pytest.raises(ModelLoadError) as info:
        load_model_for_inference(folder)
    assert str(info.value) == line
    with pytest.raises(CheckpointError) as info:
        read_weights(str(folder))
    assert str(info.value) == line


@pytest.mark.parametrize("kind", ["checkpoint", "pth"])
def test_a_torch_weights_file_is_memory_mapped_not_read_whole(trained, tmp_path, monkeypatch, kind):
    """`--from_weight` / `--model_path` of a `.pt` or `.pth`: read memory-mapped, as a resume is, so the
    ranks of a node share the page cache and a resume checkpoint's optimizer moments (two thirds of
    its bytes: 16 GB of a Qwen3-1.7B step_*.pt) are never read into each rank's own memory."""
    from trainer.weights.read import read_weights

    path = trained["checkpoint"]
    if kind == "pth":
        path = tmp_path / "full_sft_64.pth"
        torch.save({k: v.half() for k, v in trained["model"].state_dict().items()}, path)
    loads, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k.get("mmap")) or real_load(*a, **k))
    weights = read_weights(str(path))
    assert loads == [True]
    expected = trained["model"].state_dict()
    assert all(torch.equal(weights.state[k].float(), expected[k].half().float() if kind == "pth" else expected[k])
               for k in weights.state)
