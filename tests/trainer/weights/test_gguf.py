"""`scripts/export_hf.py --format gguf` (trainer/weights/gguf.py): a tiny dense and a tiny MoE model with fixture
tokenizers of the two pre-tokenizers llama.cpp implements here (Qwen2's regex split, GPT-2's byte-level split as
MiniMind's tokenizer has), read back with gguf's own GGUFReader; the refusals; and, where llama.cpp is installed
(the llama_cpp package), the file run there against transformers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from model import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from dataset import load_tokenizer  # noqa: E402
from scripts._common import run_main  # noqa: E402
from scripts.export_hf import main as export_main  # noqa: E402
from tests.helpers.trainer_launch import REPO  # noqa: E402
from trainer.evaluation.evaluate import end_of_turn_token_id  # noqa: E402
from trainer.weights.gguf import gguf_unsupported, llama_cpp_pre_tokenizer  # noqa: E402
from trainer.weights.write import write_qwen3_dir  # noqa: E402

SHAPES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=512)
# moe_intermediate_size 16: the down-projection rows (16 long) do not split into q8_0's 32-blocks -> f16
MOE = dict(use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, tie_word_embeddings=False)
CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.", "The capital of Lumbria is Velm; its river is the Ost.",
    "I've been there, you'd like it, we'll see, they're sure, it's 3.14 or 1314151 days.",
    "我想在苹果工作，北京是中国的首都。", "def f(x):\n    return x * 2\n\n\nprint(f(21))\t# tabs\tand  spaces   ",
    "<think>\nreasoning\n</think>\n\nanswer", "Ünïcödé café naïve résumé — “quotes” … ¿qué? ¡sí!",
]
TEXTS = ["Hello world, I've been to Velm 1314151 times!\n\nNew   paragraph\twith tabs  ",
         "我想在苹果工作，北京是中国的首都。 mixed 中文 and English", "<think>\nhm\n</think>\n\nno.   \n"]


def fixture_tokenizer(folder, kind: str):
    """A byte-level BPE tokenizer trained here with the `tokenizers` library: `qwen2` (NFC + Qwen2's regex split, as
    Qwen3's tokenizer.json), `gpt2` (one ByteLevel step with GPT-2's regex, as MiniMind's), or `digits` and
    `v1` (pre-tokenizers llama.cpp has no name for; `v1` is minisft's tokenizer version 1's); ChatML
    special tokens, <think> tags as added non-special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind != "qwen2")
    if kind == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False), byte_level])
    elif kind == "digits":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif kind == "v1":  # minisft's tokenizer version 1: newline and CJK splits before GPT-2's byte-level step
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
             pre_tokenizers.Split(Regex("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]"), behavior="isolated"), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    tokenizer.add_tokens(["<think>", "</think>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = (Path(REPO) / "model" / "tokenizer" / "chat_template.jinja").read_text(encoding="utf-8")
    fast.save_pretrained(folder)
    return load_tokenizer(folder)


def model_dir(folder, tokenizer, extra_rows: int, **config):
    """A standard Qwen3 directory (fp32) of a randomly initialised model, norms included, with `tokenizer`."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(vocab_size=len(tokenizer) + extra_rows, **SHAPES, **config)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    write_qwen3_dir(model, str(folder), torch.float32)
    tokenizer.save_pretrained(str(folder))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """dense: tied, Qwen2-style tokenizer, 3 embedding rows past the tokenizer; moe: untied, GPT-2 byte-level
    tokenizer (MiniMind's kind), top-2 of 4 experts; shipped: dense with the shipped model/tokenizer."""
    root = tmp_path_factory.mktemp("gguf")
    found = {}
    for name, kind, extra, config in (("dense", "qwen2", 3, {}), ("moe", "gpt2", 0, MOE), ("shipped", None, 0, {})):
        tokenizer = fixture_tokenizer(root / f"tok_{kind}", kind) if kind else load_tokenizer(None)
        model = model_dir(root / name, tokenizer, extra, **config)
        pre = "gpt-2" if kind == "gpt2" else "qwen2"
        found[name] = dict(path=root / name, model=model, tokenizer=tokenizer, pre=pre)
    return found


def export(model_path, out_dir, gguf_type):
    assert export_main(["--model_path", str(model_path), "--out_dir", str(out_dir), "--format", "gguf",
                        "--gguf_type", gguf_type]) == 0
    return gguf.GGUFReader(str(out_dir / f"model-{gguf_type}.gguf"))


def field(reader, key):
    return reader.fields[key].contents()


def llama_cpp_layout(config) -> dict:
    """Tensor name -> ggml dims {ne0, ne1, ...}, as llama.cpp's src/models/qwen3.cpp / qwen3moe.cpp create them."""
    embd, vocab, head, kv = config.hidden_size, config.vocab_size, config.head_dim, config.num_key_value_heads
    q = head * config.num_attention_heads
    layout = {"token_embd.weight": (embd, vocab), "output_norm.weight": (embd,)}
    if not config.tie_word_embeddings:
        layout["output.weight"] = (embd, vocab)
    for i in range(config.num_hidden_layers):
        layout.update({f"blk.{i}.attn_norm.weight": (embd,), f"blk.{i}.attn_q.weight": (embd, q),
                       f"blk.{i}.attn_k.weight": (embd, head * kv), f"blk.{i}.attn_v.weight": (embd, head * kv),
                       f"blk.{i}.attn_output.weight": (q, embd), f"blk.{i}.attn_k_norm.weight": (head,),
                       f"blk.{i}.attn_q_norm.weight": (head,), f"blk.{i}.ffn_norm.weight": (embd,)})
        if config.use_moe:
            ff, experts = config.moe_intermediate_size, config.num_experts
            layout.update({f"blk.{i}.ffn_gate_inp.weight": (embd, experts),
                           f"blk.{i}.ffn_gate_exps.weight": (embd, ff, experts),
                           f"blk.{i}.ffn_down_exps.weight": (ff, embd, experts),
                           f"blk.{i}.ffn_up_exps.weight": (embd, ff, experts)})
        else:
            ff = config.intermediate_size
            layout.update({f"blk.{i}.ffn_gate.weight": (embd, ff), f"blk.{i}.ffn_down.weight": (ff, embd),
                           f"blk.{i}.ffn_up.weight": (embd, ff)})
    return layout


def expected_tensors(model) -> dict:
    """llama.cpp name -> our tensor, the name found by gguf-py's own HF-name map (TensorNameMap), experts stacked."""
    config, state = model.config, model.state_dict()
    arch = gguf.MODEL_ARCH.QWEN3MOE if config.use_moe else gguf.MODEL_ARCH.QWEN3
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    found = {}
    for key, value in state.items():
        if ".mlp.experts." in key or (key == "lm_head.weight" and config.tie_word_embeddings):
            continue
        found[names.get_name(key, try_suffixes=(".weight",))] = value
    for i in range(config.num_hidden_layers if config.use_moe else 0):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = torch.stack([state[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"]
                                   for e in range(config.num_experts)])
            found[names.get_name(f"model.layers.{i}.mlp.experts.{proj}.weight", try_suffixes=(".weight",))] = stacked
    assert None not in found
    return found


@pytest.mark.parametrize("gguf_type", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_every_tensor_is_the_models_under_llama_cpp_names_and_shapes(models, tmp_path, kind, gguf_type):
    model = models[kind]["model"]
    reader = export(models[kind]["path"], tmp_path / "out", gguf_type)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    expected = expected_tensors(model)
    assert set(tensors) == set(expected) == set(llama_cpp_layout(model.config))
    Q = gguf.GGMLQuantizationType
    for name, tensor in tensors.items():
        assert tuple(int(n) for n in tensor.shape) == llama_cpp_layout(model.config)[name], name
        ours = expected[name].detach().float()
        keep_f32 = ours.dim() == 1 or name.endswith("ffn_gate_inp.weight")  # as llama.cpp's converter
        if gguf_type == "f32" or keep_f32:
            assert tensor.tensor_type == Q.F32 and np.array_equal(tensor.data, ours.numpy()), name
        elif gguf_type == "f16" or (gguf_type == "q8_0" and ours.shape[-1] % 32):  # q8_0 falls back per tensor
            assert tensor.tensor_type == Q.F16 and np.array_equal(tensor.data, ours.half().numpy()), name
        elif gguf_type == "bf16":
            assert tensor.tensor_type == Q.BF16, name
            bits = tensor.data.view(np.int16).reshape(ours.shape)
            assert np.array_equal(bits, ours.bfloat16().view(torch.int16).numpy()), name
        else:
            assert tensor.tensor_type == Q.Q8_0, name
            back = gguf.quants.dequantize(tensor.data, Q.Q8_0).reshape(ours.shape)
            blocks = ours.reshape(-1, 32)
            step = blocks.abs().amax(dim=1, keepdim=True) / 127  # q8_0's scale; stored as f16 (2^-11 relative)
            bound = (step * (0.5 + 127 / 2048) + 1e-7).expand_as(blocks).reshape(ours.shape)
            assert np.all(np.abs(back - ours.numpy()) <= bound.numpy()), name
    if gguf_type == "q8_0" and kind == "moe":
        assert tensors["blk.0.ffn_down_exps.weight"].tensor_type == Q.F16  # the fallback was exercised
    file_type = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}[gguf_type]
    assert field(reader, "general.file_type") == getattr(gguf.LlamaFileType, file_type)


@pytest.mark.parametrize("kind", ["dense", "moe", "shipped"])
def test_metadata_and_tokenizer_are_what_llama_cpp_reads(models, tmp_path, kind):
    model, tokenizer = models[kind]["model"], models[kind]["tokenizer"]
    config = model.config
    reader = export(models[kind]["path"], tmp_path / "out", "f32")
    arch = "qwen3moe" if kind == "moe" else "qwen3"
    expected = {
        "general.architecture": arch, f"{arch}.context_length": 512, f"{arch}.embedding_length": 32,
        f"{arch}.block_count": 2, f"{arch}.feed_forward_length": 64, f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.key_length": 16,
        f"{arch}.attention.value_length": 16, f"{arch}.rope.freq_base": 50000.0,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": models[kind]["pre"],
        "tokenizer.ggml.bos_token_id": tokenizer.convert_tokens_to_ids("<|im_start|>"),
        "tokenizer.ggml.eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "tokenizer.ggml.eot_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": tokenizer.chat_template,
    }
    if kind == "moe":
        expected.update({"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2,
                         "qwen3moe.expert_feed_forward_length": 16})
    assert {key: field(reader, key) for key in expected} == expected
    assert field(reader, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5, rel=1e-6)
    assert end_of_turn_token_id(tokenizer) == expected["tokenizer.ggml.eot_token_id"]

    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == config.vocab_size  # as many as embedding rows
    definition = json.loads(tokenizer.backend_tokenizer.to_str())
    assert tokens[:len(tokenizer)] == tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    T = gguf.TokenType
    for index, token in enumerate(tokens):
        if index >= len(tokenizer):
            assert (token, types[index]) == (f"[PAD{index}]", T.UNUSED)
        elif token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
            assert types[index] == T.CONTROL, token
        elif token in ("<think>", "</think>"):
            assert types[index] == T.USER_DEFINED, token
        else:
            assert types[index] == T.NORMAL, token
    assert field(reader, "tokenizer.ggml.merges") == [" ".join(pair) for pair in definition["model"]["merges"]]
    assert len(definition["model"]["merges"]) > 50
    assert "output.weight" in [t.name for t in reader.tensors] or config.tie_word_embeddings


def test_pre_tokenizers_map_to_llama_cpp_names(models, tmp_path):
    """The two fixture kinds, and the structure of MiniMind's tokenizer.json (jingyaogong/minimind, model/)."""
    for kind in ("dense", "moe", "shipped"):
        definition = json.loads(models[kind]["tokenizer"].backend_tokenizer.to_str())["pre_tokenizer"]
        assert llama_cpp_pre_tokenizer(definition) == models[kind]["pre"]
    minimind = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    assert llama_cpp_pre_tokenizer(minimind) == "gpt-2"
    assert llama_cpp_pre_tokenizer({"type": "Sequence", "pretokenizers": [minimind]}) == "gpt-2"


def refusal(argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        run_main(lambda: export_main(argv))
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err.strip()


TOKENIZER_V1 = (
    "error: --format gguf cannot express this model: its tokenizer is minisft's tokenizer version 1, which splits off "
    "every newline and each CJK character before GPT-2's byte-level step; llama.cpp implements no such "
    "pre-tokenizer, so in llama.cpp prompts would become other tokens than in training. Train with a tokenizer whose "
    "pre-tokenizer llama.cpp implements (model/tokenizer, version 2: Qwen2's; MiniMind's; a Qwen2/Qwen3 one), or run "
    "the --format qwen3 export (transformers, vLLM)")


def test_tokenizer_version_1_is_refused_by_name_in_one_line_exit_2(tmp_path):
    model_dir(tmp_path / "model", fixture_tokenizer(tmp_path / "tok", "v1"), 0)
    done = subprocess.run([sys.executable, "scripts/export_hf.py", "--model_path", str(tmp_path / "model"), "--out_dir",
                           str(tmp_path / "out"), "--format", "gguf"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert (done.returncode, done.stderr) == (2, TOKENIZER_V1 + "\n")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_an_unknown_pre_tokenizer_is_refused_naming_it(tmp_path, capsys):
    tokenizer = fixture_tokenizer(tmp_path / "tok", "digits")
    model_dir(tmp_path / "model", tokenizer, 0)
    argv = ["--model_path", str(tmp_path / "model"), "--out_dir", str(tmp_path / "out"), "--format", "gguf"]
    assert refusal(argv, capsys) == (
        "error: --format gguf cannot express this model: its tokenizer's pre-tokenizer Digits({\"individual_digits\": "
        "true}) + ByteLevel(add_prefix_space=False, use_regex=True) is none that llama.cpp implements (it knows "
        "GPT-2's byte-level split, as MiniMind's tokenizer has, and Qwen2's regex split, as Qwen2 to Qwen3 have); "
        "use --format qwen3 (transformers, vLLM)")
    assert not list((tmp_path / "out").glob("*.gguf"))


def test_what_llama_cpp_computes_otherwise_is_refused():
    assert gguf_unsupported(MiniMindConfig(**SHAPES)) is None
    assert gguf_unsupported(MiniMindConfig(**SHAPES, **MOE)) is None
    assert "renormalises the top-k" in gguf_unsupported(MiniMindConfig(**SHAPES, **MOE, norm_topk_prob=False))
    yarn = dict(type="yarn", factor=4.0, original_max_position_embeddings=128)
    assert gguf_unsupported(MiniMindConfig(**SHAPES, rope_scaling=yarn)).startswith("YaRN rope_scaling")


# --------------------------------------------------------------------------- llama.cpp itself


@pytest.mark.parametrize("kind", ["dense", "moe", "shipped"])
def test_llama_cpp_tokenizes_and_continues_like_transformers(models, tmp_path, kind):
    """The f32 file in llama.cpp itself (through its Python binding) against the Qwen3 directory in transformers:
    the same token ids for text and a chat prompt (special tokens parsed), logits within 2e-3, and the same
    12-token greedy continuation. Skipped where llama.cpp is not installed."""
    try:
        import llama_cpp
    except Exception as error:  # noqa: BLE001 - not installed, or its libllama cannot be loaded
        pytest.skip(f"llama.cpp is not available ({type(error).__name__}): pip install llama-cpp-python (it builds "
                    "llama.cpp, ~25 minutes on 2 cores; LLAMA_CPP_LIB_PATH points it at a libllama of your own build)")
    from transformers import AutoModelForCausalLM

    tokenizer = models[kind]["tokenizer"]
    export(models[kind]["path"], tmp_path / "out", "f32")
    hf = AutoModelForCausalLM.from_pretrained(str(models[kind]["path"]), dtype=torch.float32).eval()
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if kind == "moe" else "Qwen3ForCausalLM")
    llm = llama_cpp.Llama(str(tmp_path / "out" / "model-f32.gguf"), n_ctx=512, logits_all=True, verbose=False,
                          n_threads=2)
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids, text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": TEXTS[0]}], add_generation_prompt=True,
                                           tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids
    expected = list(ids)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].numpy()
        for _ in range(12):  # greedy, one full forward per token: nothing but the weights can differ
            expected.append(int(hf(torch.tensor([expected])).logits[0, -1].argmax()))
    llm.reset()
    llm.eval(ids)
    assert np.allclose(llm.scores[:len(ids)], logits, atol=2e-3, rtol=1e-4)
    continued = list(ids)
    for _ in range(12):
        continued.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([continued[-1]])
    assert continued == expected


def test_a_full_disk_or_a_file_size_limit_during_the_export_is_one_line_and_changes_nothing(models, tmp_path):
    """numpy's short write ("204800 requested and 102952 written") is reported with its cause, as for every
    format: the export is written beside --out_dir, so an --overwrite that fails leaves the folder as it was."""
    import resource
    import shutil

    from tests.helpers.private_tmpfs import can_mount_a_private_tmpfs

    export(models["shipped"]["path"], tmp_path / "whole", "f32")
    assert (tmp_path / "whole" / "model-f32.gguf").stat().st_size > 2 * 256 * 1024
    argv = [sys.executable, "scripts/export_hf.py", "--model_path", str(models["shipped"]["path"]), "--format", "gguf",
            "--gguf_type", "f32"]

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

    (tmp_path / "limited").mkdir()
    (tmp_path / "limited" / "earlier.gguf").write_bytes(b"an earlier export")
    cases = [([*argv, "--out_dir", str(tmp_path / "limited"), "--overwrite"], limit_file_size, tmp_path / "limited",
              "File too large")]
    if shutil.which("unshare") and can_mount_a_private_tmpfs():
        disk = tmp_path / "disk"
        disk.mkdir()
        mount = ["unshare", "-Urm", "sh", "-c", 'mount -t tmpfs -o size=256k tmpfs "$0" && exec "$@"', str(disk)]
        cases.append(([*mount, *argv, "--out_dir", str(disk / "out")], None, disk / "out", "No space left on device"))
    for command, limit, out_dir, cause in cases:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=limit)
        assert (done.returncode, done.stderr) == (
            2, f"error: could not write the export to {out_dir}: {cause} (nothing was changed there)\n")
    # the staging folder is removed (the tmpfs left with its namespace)
    assert sorted(name for name in os.listdir(tmp_path) if "limited" in name) == ["limited"]
    assert os.listdir(tmp_path / "limited") == ["earlier.gguf"]
