"""MiniMind .pth state dicts (trainer/weights/read.py, write.py): the --from_weight name, fp16, the export."""

import pytest
import torch

from model import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.overfitted import script_in_process
from tests.helpers.tiny_weights import RUN, demo_slices, setup, whole_file_batch
from tests.helpers.trainer_launch import assert_weights_equal, run_trainer_in_process, train_losses
from trainer.errors import CheckpointError
from trainer.weights.inference import load_model_for_inference

data = pytest.fixture(scope="module", name="data")(demo_slices)


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
    result = run_trainer_in_process([*RUN, "--from_weight", "pretrain", "--hidden_size", "32", "--data_path",
                                     str(data / "eight.jsonl"), "--batch_size", "8", "--max_steps", "1", "--save_dir",
                                     str(run), "--save_weight", "sft"], check=True)
    assert f"weights: MiniMind state dict {run / 'pretrain_32.pth'}" in result.stdout
    start = MiniMindForCausalLM(MiniMindConfig(**layout)).eval()
    start.load_state_dict({**half, "lm_head.weight": half["model.embed_tokens.weight"]})
    with torch.no_grad():
        expected = start(**whole_file_batch(data / "eight.jsonl", tokenizer)).loss.item()
    assert train_losses(run)[1] == pytest.approx(expected, rel=1e-5)

    export = tmp_path / "minimind_out"
    done = script_in_process("export_hf.py", "--model_path", str(run), "--out_dir", str(export), "--format", "minimind",
                             "--save_weight", "full_sft")
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


def test_export_refuses_a_format_that_cannot_express_the_model(qwen3_dirs, tmp_path, capsys):
    from scripts.export_hf import main

    with pytest.raises(SystemExit) as done:
        main(["--model_path", str(qwen3_dirs["moe"]), "--out_dir", str(tmp_path), "--format", "minimind"])
    assert done.value.code == 2
    assert capsys.readouterr().err == ("error: --format minimind cannot express this model: the LM head is not tied "
                                       "to the embedding (MiniMind always ties them) (use --format remote-code)\n")


@pytest.mark.parametrize("layout, settings", [
    (dict(hidden_size=36, num_attention_heads=1, num_key_value_heads=1),  # MiniMind's 8 heads do not divide 36
     {"num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 36}),
    (dict(hidden_size=40, num_attention_heads=20, num_key_value_heads=4),  # MiniMind's head_dim 40 // 8 = 5, odd
     {"num_attention_heads": 20, "head_dim": 2}),
    (dict(hidden_size=100, num_attention_heads=5, num_key_value_heads=5, use_moe=True, num_experts=3),
     {"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": 20, "num_experts": 3}),
])
def test_minimind_settings_of_a_width_minimind_s_default_heads_do_not_split(layout, settings):
    """MiniMind's config derives head_dim = hidden_size // 8 (its default heads) without a check, so the
    settings of a model whose width its 8 heads do not split evenly are the fields that differ from that."""
    from trainer.weights.write import minimind_settings

    assert minimind_settings(MiniMindConfig(num_hidden_layers=1, **layout)) == settings


def test_the_pth_of_a_model_on_a_gpu_holds_host_tensors(monkeypatch, tmp_path):
    """`--save_weight` and `export_hf.py --format minimind` of a model on a GPU: the file's tensors are
    on the host, fp16, every key (a GPU's tensors would load only where that GPU is)."""
    import types

    from torch._subclasses.fake_tensor import FakeTensorMode

    from tests.helpers.tiny_model import tiny_model
    from trainer.weights import write

    model = tiny_model()
    state, saved = model.state_dict(), {}
    monkeypatch.setattr(write, "atomic_torch_save", lambda state, path: saved.update(state))
    with FakeTensorMode():
        on_gpu = {key: torch.empty(value.shape, dtype=value.dtype, device="cuda") for key, value in state.items()}
        write.write_minimind_pth(types.SimpleNamespace(config=model.config, state_dict=lambda: on_gpu), str(tmp_path))
    assert sorted(saved) == sorted(model.state_dict())
    assert {(value.device.type, value.dtype) for value in saved.values()} == {("cpu", torch.float16)}
