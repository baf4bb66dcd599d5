"""GGUF for llama.cpp and Ollama: `scripts/export_hf.py --format gguf --gguf_type f32|f16|bf16|q8_0`.

One file, written with ggml-org's own `gguf` package (GGUFWriter), holds what llama.cpp's
`qwen3` / `qwen3moe` architectures read (the names and keys of gguf-py's constants, as llama.cpp's
convert_hf_to_gguf.py writes them for Qwen3 / Qwen3-MoE):

- the tensors under llama.cpp's names (`token_embd`, `blk.N.attn_q`, ..., the experts of a layer
  stacked into `blk.N.ffn_{gate,up,down}_exps`; a tied LM head is left out, llama.cpp reuses
  `token_embd`), 1-D tensors and the router in f32 as the converter keeps them; q8_0 falls back to
  f16 for a tensor whose rows do not divide into blocks of 32, as the converter does;
- the hyperparameters (context length, widths, layers, heads, head size, rope base, rms eps,
  expert counts and size);
- the tokenizer as llama.cpp's byte-level BPE (`tokenizer.ggml.model` "gpt2"): tokens, token types,
  merges, the pre-tokenizer under the name llama.cpp gives exactly that pre-tokenizer, bos / eos /
  pad / unk and the chat template's end-of-turn ids, whether bos / eos are added, the chat template.

Nothing is approximated: a tokenizer or model llama.cpp would run differently from training is
refused with a one-line `GGUFError` that says why, above all a pre-tokenizer llama.cpp does not
implement, such as that of minisft's tokenizer version 1 (it isolates every newline and each CJK
character before GPT-2's byte-level split; model/tokenizer is version 2, Qwen2's split, which maps
to llama.cpp's `qwen2`). CHANGELOG.md lists the tokenizer versions.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from trainer.errors import ModelLoadError

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")

# Qwen2's (and Qwen2.5's, Qwen3's) split regex, as its tokenizer.json and transformers' Qwen2Tokenizer spell it.
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Pre-tokenizers (as steps, see `_step`) -> the `tokenizer.ggml.pre` name llama.cpp implements them under.
LLAMA_CPP_PRE_TOKENIZERS = {
    (("ByteLevel", False, True),): "gpt-2",  # GPT-2's own regex inside the byte-level step (MiniMind's tokenizer)
    (("Split", "Regex", QWEN2_REGEX, "Isolated", False), ("ByteLevel", False, False)): "qwen2",  # Qwen2 .. Qwen3
}
# minisft's tokenizer version 1 (fingerprint fd9a7e13...; CHANGELOG.md): newline and CJK splits before GPT-2's
# byte-level step. Models trained with it stay readable everywhere but in GGUF, which is refused by name.
TOKENIZER_V1_PRE_TOKENIZER = (("Split", "Regex", "\n", "Isolated", False),
                              ("Split", "Regex", "[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]", "Isolated", False),
                              ("ByteLevel", False, True))
TOKENIZER_V1_REFUSAL = (
    "its tokenizer is minisft's tokenizer version 1, which splits off every newline and each CJK character "
    "before GPT-2's byte-level step; llama.cpp implements no such pre-tokenizer, so in llama.cpp prompts would "
    "become other tokens than in training. Train with a tokenizer whose pre-tokenizer llama.cpp implements "
    "(model/tokenizer, version 2: Qwen2's; MiniMind's; a Qwen2/Qwen3 one), or run the --format qwen3 export "
    "(transformers, vLLM)")


class GGUFError(ModelLoadError):
    """A model or tokenizer that has no faithful GGUF form; the one-line message says why."""


# --------------------------------------------------------------------------- the model


def gguf_unsupported(config) -> str | None:
    """Why llama.cpp's qwen3 / qwen3moe cannot compute what this model computes (None: it can)."""
    if config.rope_yarn:
        return ("YaRN rope_scaling is not exported to GGUF: llama.cpp's YaRN settings are not checked against "
                "this model's; use --format qwen3")
    if config.use_moe and not config.norm_topk_prob:
        return ("norm_topk_prob is false, but llama.cpp's qwen3moe always renormalises the top-k router weights; "
                "use --format qwen3")
    return None


def _architecture(config):
    import gguf

    return gguf.MODEL_ARCH.QWEN3MOE if config.use_moe else gguf.MODEL_ARCH.QWEN3


def gguf_tensors(model):
    """(gguf tensor kind, block id or None, tensor) for every tensor llama.cpp reads, in file order."""
    import gguf

    T = gguf.MODEL_TENSOR
    config, state = model.config, model.state_dict()
    yield T.TOKEN_EMBD, None, state["model.embed_tokens.weight"]
    attention = ((T.ATTN_NORM, "input_layernorm"), (T.ATTN_Q, "self_attn.q_proj"), (T.ATTN_K, "self_attn.k_proj"),
                 (T.ATTN_V, "self_attn.v_proj"), (T.ATTN_OUT, "self_attn.o_proj"), (T.ATTN_Q_NORM, "self_attn.q_norm"),
                 (T.ATTN_K_NORM, "self_attn.k_norm"), (T.FFN_NORM, "post_attention_layernorm"))
    for block in range(config.num_hidden_layers):
        prefix = f"model.layers.{block}."
        for kind, name in attention:
            yield kind, block, state[f"{prefix}{name}.weight"]
        if config.use_moe:
            yield T.FFN_GATE_INP, block, state[f"{prefix}mlp.gate.weight"]
            for kind, name in ((T.FFN_GATE_EXP, "gate_proj"), (T.FFN_UP_EXP, "up_proj"), (T.FFN_DOWN_EXP, "down_proj")):
                yield kind, block, torch.stack([state[f"{prefix}mlp.experts.{expert}.{name}.weight"]
                                                for expert in range(config.num_experts)])
        else:
            for kind, name in ((T.FFN_GATE, "gate_proj"), (T.FFN_UP, "up_proj"), (T.FFN_DOWN, "down_proj")):
                yield kind, block, state[f"{prefix}mlp.{name}.weight"]
    yield T.OUTPUT_NORM, None, state["model.norm.weight"]
    if not config.tie_word_embeddings:
        yield T.OUTPUT, None, state["lm_head.weight"]


def gguf_tensor_name(kind, block: int | None) -> str:
    import gguf

    return gguf.TENSOR_NAMES[kind].format(bid=block) + ".weight"


def encode_tensor(kind, tensor: torch.Tensor, gguf_type: str):
    """(numpy data, GGMLQuantizationType) of one tensor for `--gguf_type`; the rules of llama.cpp's converter:
    1-D tensors and the MoE router stay f32; q8_0 falls back to f16 where rows do not split into 32-blocks."""
    import gguf

    Q = gguf.GGMLQuantizationType
    data = tensor.detach().to("cpu", torch.float32).contiguous()
    if gguf_type == "f32" or data.dim() <= 1 or kind == gguf.MODEL_TENSOR.FFN_GATE_INP:
        return data.numpy(), Q.F32
    if gguf_type == "bf16":  # torch's round-to-nearest-even cast, as bytes
        return data.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8), Q.BF16
    if gguf_type == "q8_0":
        try:
            return gguf.quants.quantize(data.numpy(), Q.Q8_0), Q.Q8_0
        except gguf.QuantError:
            pass
    return data.to(torch.float16).numpy(), Q.F16


# --------------------------------------------------------------------------- the tokenizer


def _step(step: dict) -> tuple:
    """A pre-tokenizer step as the tuple it is compared by (offsets settings do not change tokens)."""
    kind = step.get("type")
    if kind == "ByteLevel":
        return ("ByteLevel", bool(step.get("add_prefix_space", True)), bool(step.get("use_regex", True)))
    if kind == "Split":
        pattern = step.get("pattern") or {}
        how = "Regex" if "Regex" in pattern else "String"
        return ("Split", how, pattern.get(how), step.get("behavior"), bool(step.get("invert")))
    return (kind, json.dumps({k: v for k, v in step.items() if k != "type"}, sort_keys=True, ensure_ascii=True))


def pre_tokenizer_steps(definition: dict | None) -> tuple:
    """The steps of a tokenizer.json `pre_tokenizer` (a `Sequence` flattened)."""
    if not definition:
        return ()
    if definition.get("type") == "Sequence":
        return tuple(step for inner in definition.get("pretokenizers", []) for step in pre_tokenizer_steps(inner))
    return (_step(definition),)


def describe_pre_tokenizer(steps: tuple) -> str:
    """One line naming the steps, e.g. `Split(Regex '\\n', Isolated) + ByteLevel(use_regex=True, ...)`."""
    if not steps:
        return "none"
    parts = []
    for step in steps:
        if step[0] == "ByteLevel":
            parts.append(f"ByteLevel(add_prefix_space={step[1]}, use_regex={step[2]})")
        elif step[0] == "Split":
            pattern = repr(step[2]) if len(repr(step[2])) <= 90 else repr(step[2])[:87] + "...'"
            parts.append(f"Split({step[1]} {pattern}, {step[3]}{', inverted' if step[4] else ''})")
        else:
            parts.append(f"{step[0]}({step[1][:80]})")
    return " + ".join(parts)


def llama_cpp_pre_tokenizer(definition: dict | None) -> str:
    """The `tokenizer.ggml.pre` name of a tokenizer.json `pre_tokenizer`; GGUFError for one llama.cpp lacks."""
    steps = pre_tokenizer_steps(definition)
    if steps in LLAMA_CPP_PRE_TOKENIZERS:
        return LLAMA_CPP_PRE_TOKENIZERS[steps]
    if steps == TOKENIZER_V1_PRE_TOKENIZER:
        raise GGUFError(TOKENIZER_V1_REFUSAL)
    raise GGUFError(f"its tokenizer's pre-tokenizer {describe_pre_tokenizer(steps)} is none that llama.cpp "
                    "implements (it knows GPT-2's byte-level split, as MiniMind's tokenizer has, and Qwen2's regex "
                    "split, as Qwen2 to Qwen3 have); use --format qwen3 (transformers, vLLM)")


def _looks_special(text: str) -> bool:
    # llama.cpp's converter marks added tokens like <|...|> as control tokens even when not flagged special
    return text.startswith("<|") and text.endswith("|>")


def gguf_vocab(tokenizer, vocab_size: int) -> dict:
    """Everything `tokenizer.ggml.*` holds, from the tokenizer's own definition (its tokenizer.json); `notes`
    lists what the caller should tell the user. Raises GGUFError for anything llama.cpp would do otherwise."""
    import gguf

    definition = json.loads(tokenizer.backend_tokenizer.to_str())
    pre = llama_cpp_pre_tokenizer(definition.get("pre_tokenizer"))
    bpe = definition.get("model") or {}
    if bpe.get("type") != "BPE" or bpe.get("byte_fallback") or bpe.get("continuing_subword_prefix") \
            or bpe.get("end_of_word_suffix") or bpe.get("ignore_merges") or bpe.get("dropout"):
        raise GGUFError("its tokenizer model is not plain byte-level BPE (type BPE without byte_fallback, subword "
                        "prefix/suffix, ignore_merges or dropout), which is what llama.cpp's gpt2 tokenizer runs")
    decoder = (definition.get("decoder") or {}).get("type")
    if decoder != "ByteLevel":
        raise GGUFError(f"its tokenizer's decoder is {decoder}, but llama.cpp decodes byte-level BPE (ByteLevel)")
    normalizer = definition.get("normalizer") or {}
    notes = []
    if normalizer.get("type") == "NFC":
        notes.append("note: llama.cpp does not apply the tokenizer's NFC normalizer first (text already in NFC, "
                     "as nearly all text is, tokenizes the same)")
    elif normalizer and not (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")):
        raise GGUFError(f"its tokenizer has a {normalizer.get('type')} normalizer, which llama.cpp does not apply")
    added = {token["id"]: token for token in definition.get("added_tokens", [])}
    stripping = [t["content"] for t in added.values() if t.get("lstrip") or t.get("rstrip") or t.get("single_word")]
    if stripping:
        raise GGUFError(f"added token {stripping[0]!r} strips spaces or matches single words only, which llama.cpp "
                        "does not do")
    by_id = {index: text for text, index in bpe.get("vocab", {}).items()}
    by_id.update({index: token["content"] for index, token in added.items()})
    if max(by_id) >= vocab_size:
        raise GGUFError(f"its tokenizer has token id {max(by_id)}, beyond the model's {vocab_size} embeddings")
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(by_id[index])
            special = added[index].get("special") or _looks_special(by_id[index])
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in bpe.get("merges", [])]
    if any(not isinstance(merge, str) and any(" " in part for part in merge) for merge in bpe.get("merges", [])):
        raise GGUFError("its tokenizer has a merge of a piece with a space, which llama.cpp's merges cannot hold")
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    extra = len(with_special) - len(plain)
    add_bos = extra > 0 and tokenizer.bos_token_id is not None and with_special[0] == tokenizer.bos_token_id
    add_eos = extra > 0 and tokenizer.eos_token_id is not None and with_special[-1] == tokenizer.eos_token_id
    if extra != int(add_bos) + int(add_eos):
        raise GGUFError("its tokenizer adds tokens other than bos/eos around a text, which llama.cpp does not do")
    from trainer.evaluation.evaluate import end_of_turn_token_id

    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = [{"name": name, "template": text} for name, text in template.items()]
    return dict(pre=pre, tokens=tokens, types=types, merges=merges, add_bos=add_bos, add_eos=add_eos,
                bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id,
                unk=tokenizer.unk_token_id, eot=end_of_turn_token_id(tokenizer), template=template, notes=notes)


# --------------------------------------------------------------------------- the file


FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}


def write_gguf(model, tokenizer, path: str | Path, gguf_type: str = "f16", name: str = "minisft") -> list[str]:
    """Write `model` + `tokenizer` as one GGUF file at `path` (atomically); returns the notes for the user.
    Everything is checked before a byte is written: GGUFError says what has no faithful GGUF form."""
    import gguf

    if gguf_type not in GGUF_TYPES:
        raise GGUFError(f"--gguf_type {gguf_type}: not one of {', '.join(GGUF_TYPES)}")
    config = model.config
    reason = gguf_unsupported(config)
    if reason:
        raise GGUFError(reason)
    vocab = gguf_vocab(tokenizer, config.vocab_size)
    arch = _architecture(config)
    path = Path(path)
    staging = path.with_name(f".{path.name}.tmp")
    writer = gguf.GGUFWriter(str(staging), gguf.MODEL_ARCH_NAMES[arch])
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name)
        writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[gguf_type]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_rope_freq_base(float(config.rope_theta))
        writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
        if config.use_moe:
            writer.add_expert_count(config.num_experts)
            writer.add_expert_used_count(config.num_experts_per_tok)
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        _add_vocab(writer, vocab)
        known = set(gguf.MODEL_TENSORS[arch])
        for kind, block, tensor in gguf_tensors(model):
            assert kind in known, f"{kind} is not a tensor of llama.cpp's {gguf.MODEL_ARCH_NAMES[arch]}"
            data, qtype = encode_tensor(kind, tensor, gguf_type)
            writer.add_tensor(gguf_tensor_name(kind, block), data, raw_dtype=qtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(staging, path)
    except BaseException as error:
        failed = write_error(error, staging, path) if isinstance(error, OSError) else None
        with contextlib.suppress(OSError):  # its buffered bytes meet the same full disk
            writer.close()
        staging.unlink(missing_ok=True)
        if failed is not None:
            raise failed from None
        raise
    return vocab["notes"]


def write_error(error: OSError, staging: Path, path: Path) -> OSError:
    """A failed write of the GGUF file as an OSError naming ``path`` (the file asked for) and the cause.

    numpy's ``tofile`` reports a short write (a full disk, the file size limit) only as "N requested
    and M written", without errno: one more byte appended to ``staging`` fails with the cause."""
    if error.errno is None:
        try:
            with open(staging, "ab") as handle:
                handle.write(b"\0")
        except OSError as cause:
            error = cause
    if error.errno is None:
        named = OSError(f"a short write ({error})")
        named.filename = str(path)
        return named
    return OSError(error.errno, error.strerror, str(path))


def _add_vocab(writer, vocab: dict) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    for key in ("bos", "eos", "pad", "unk", "eot"):
        if vocab[key] is not None:
            getattr(writer, f"add_{key}_token_id")(vocab[key])
    writer.add_add_bos_token(vocab["add_bos"])
    writer.add_add_eos_token(vocab["add_eos"])
    writer.add_chat_template(vocab["template"])


def export_gguf(model, tokenizer, folder: str | Path, gguf_type: str, out_dir: Path) -> list[str]:
    """`export_hf.py --format gguf`: `{folder}/model-{gguf_type}.gguf`, the file that is moved into `out_dir`
    (whose name the file records as the model's); returns the lines that tell what `out_dir` then holds."""
    name = f"model-{gguf_type}.gguf"
    try:
        notes = write_gguf(model, tokenizer, Path(folder) / name, gguf_type, name=out_dir.resolve().name)
    except GGUFError as error:
        raise GGUFError(f"--format gguf cannot express this model: {error}") from None
    arch = "qwen3moe" if model.config.use_moe else "qwen3"
    return [*notes, f"exported {gguf_type} GGUF ({arch}, {len(tokenizer)} tokens) to {out_dir / name}"]
