"""transformers 4.57, in its own venv, reads the exported model and tokenizer as transformers 5 does."""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from model import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.trainer_launch import clean_env
from trainer.weights.inference import load_model_for_inference


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
    export: RoPE theta 1e6 (4.x fell back to 1e4 without a top-level rope_theta), YaRN (also with a correction range
    past the last frequency, which 4.x clamps as 5 does), MoE; the tokenizer class (4.x has no TokenizersBackend)."""
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
        "yarn_far": MiniMindConfig(**layout, rope_theta=100.0, rope_scaling={  # model/rope.py, yarn_ramp
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "ramp": "transformers"}),
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
        assert old[name]["tokenizer"] == "PreTrainedTokenizerFast"
        assert old[name]["rope_theta"] == models[name].rope_theta
        new_tokenizer = AutoTokenizer.from_pretrained(folder)
        assert old[name]["ids"] == [new_tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        assert old[name]["ids"] == [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        assert old[name]["template"] == new_tokenizer.chat_template == tokenizer.chat_template
        with torch.no_grad():
            new = AutoModelForCausalLM.from_pretrained(folder).eval()(torch.tensor([ids])).logits
            ours = load_model_for_inference(folder)(torch.tensor([ids])).logits
        assert torch.allclose(old[name]["logits"], new, atol=1e-5, rtol=0), name
        assert torch.allclose(new, ours, atol=1e-5, rtol=0), name


TF4_FINGERPRINTS = textwrap.dedent("""
    import json, sys, transformers
    from transformers import AutoTokenizer
    from trainer.weights.tokenizer import definition_fingerprint
    result = {"version": transformers.__version__}
    for folder in sys.argv[1].split(","):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        result[folder] = definition_fingerprint(tokenizer)
        tokenizer.save_pretrained(folder + "-resaved")
    print(json.dumps(result))
""")


@pytest.mark.slow
def test_the_recorded_tokenizer_fingerprint_is_the_same_under_transformers_4(tmp_path, tokenizer):
    """The fingerprint a weights folder records (trainer/weights/tokenizer.py: definition_fingerprint) of the
    shipped tokenizer, one with another chat template and one with another vocabulary is computed alike by
    transformers 4.57 (PreTrainedTokenizerFast, tokenizers 0.22) and 5 (TokenizersBackend); the files 4.57
    saves again (other bytes) are accepted here as the same tokenizer."""
    from dataset import load_tokenizer
    from tests.helpers.templates import make_alt_tokenizer
    from tests.helpers.trainer_launch import REPO
    from tests.trainer.test_model_setup import custom_tokenizer
    from trainer.weights.tokenizer import definition_fingerprint
    from trainer.weights.write import write_tokenizer

    python = transformers4_python()
    sources = {"shipped": tokenizer, "template": load_tokenizer(custom_tokenizer(tmp_path / "template-source")),
               "vocabulary": load_tokenizer(make_alt_tokenizer(tmp_path / "vocabulary-source"))}
    for name, source in sources.items():
        write_tokenizer(source, str(tmp_path / name))
    env = {**{k: v for k, v in clean_env().items() if k != "PYTHONPATH"}, "PYTHONPATH": str(REPO)}
    done = subprocess.run([python, "-c", TF4_FINGERPRINTS, ",".join(str(tmp_path / name) for name in sources)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    old = json.loads(done.stdout.strip().splitlines()[-1])
    assert old["version"].startswith("4.57.")
    fingerprints = [definition_fingerprint(source) for source in sources.values()]
    assert len(set(fingerprints)) == 3
    for name, fingerprint in zip(sources, fingerprints):
        assert old[str(tmp_path / name)] == fingerprint, name
        resaved = tmp_path / f"{name}-resaved"
        config = "tokenizer_config.json"
        assert (resaved / config).read_bytes() != (tmp_path / name / config).read_bytes()  # saved otherwise
        assert definition_fingerprint(load_tokenizer(resaved)) == fingerprint, name
