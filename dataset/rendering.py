"""Tokenizer loading and chat rendering with assistant-only loss masks, for any HF chat template.

How the mask is found without knowing the template: for every assistant message ``i`` we render

* ``prompt_i`` = messages[:i] with ``add_generation_prompt=True`` (ends where the reply starts),
* ``turn_i``   = messages[:i + 1] (ends after the reply's end-of-turn marker),

and check that ``prompt_i`` is a prefix of ``turn_i`` and ``turn_i`` a prefix of the full text
(the "prefix property"). The character span ``[len(prompt_i), len(turn_i.rstrip()))`` is the
reply plus its end-of-turn token (``<|im_end|>`` for ChatML) without the trailing newline. A
token carries loss when its characters overlap such a span (fast-tokenizer offsets), so a token
that merges a header's trailing space with the reply's first word is learned, as in HF's
``return_assistant_tokens_mask``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from .formats import DataError, LineError

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "model" / "tokenizer"


class TemplateError(Exception):
    """The chat template cannot be used for loss masking (not prefix-stable); never skippable."""


def load_tokenizer(path: str | Path | None = None):
    """Load a fast HF tokenizer with a chat template (``None``: the shipped ``model/tokenizer``).

    Raises a one-line ``DataError`` if the directory is missing, cannot be loaded, is not a fast
    tokenizer (offsets are needed) or has no chat template. A tokenizer without a pad token gets
    its eos token as pad token (pads never carry loss).
    """
    from transformers import AutoTokenizer

    directory = Path(path) if path is not None else DEFAULT_TOKENIZER_DIR
    if not directory.is_dir():
        raise DataError(f"{directory}: tokenizer directory not found")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # noqa: BLE001 - any loading failure becomes one line
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{directory}: cannot load tokenizer ({message})") from None
    check_tokenizer(tokenizer, str(directory))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_tokenizer(tokenizer, name: str = "tokenizer") -> None:
    """Raise ``DataError`` unless ``tokenizer`` is a fast tokenizer with a chat template."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{name}: a fast tokenizer is required (character offsets are used for loss masks)")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{name}: tokenizer has no chat_template")


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of everything that changes token ids: vocab/merges/special tokens/normalizer and the template.

    Uses the serialized backend (``tokenizer.json`` content), so it needs no encoding call.
    """
    digest = hashlib.sha256()
    digest.update(tokenizer.backend_tokenizer.to_str().encode("utf-8"))
    template = tokenizer.chat_template
    digest.update(json.dumps(template, sort_keys=True).encode("utf-8"))
    specials = {name: str(getattr(tokenizer, name, None)) for name in ("bos_token", "eos_token", "pad_token")}
    digest.update(json.dumps(specials, sort_keys=True).encode("utf-8"))
    digest.update(type(tokenizer).__name__.encode("utf-8"))
    return digest.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned integer dtype that holds ids ``0 .. vocab_size - 1``."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - e.g. a template's raise_exception on role order
        raise LineError(f"chat template rejected the conversation ({exc})") from None


def loss_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages``; return the text and the character spans that carry loss."""
    text = _render(tokenizer, messages)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if index == 0:
            raise LineError("conversation starts with an assistant message")
        prompt = _render(tokenizer, messages[:index], add_generation_prompt=True)
        turn = _render(tokenizer, messages[: index + 1])
        if not (turn.startswith(prompt) and text.startswith(turn)):
            raise TemplateError(
                "chat template is not prefix-stable (rendering a conversation prefix does not give a prefix "
                f"of the full text at message {index + 1}); assistant-only loss masks cannot be derived"
            )
        if message["content"].strip() not in turn[len(prompt) :]:
            raise TemplateError(
                f"chat template does not render assistant message {index + 1} after its generation prompt; "
                "assistant-only loss masks cannot be derived"
            )
        end = len(turn.rstrip())
        if end > len(prompt):
            spans.append((len(prompt), end))
    return text, spans


def encode_conversation(tokenizer, messages: list[dict], max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int64) and loss mask (bool) of one conversation, truncated to ``max_seq_len``."""
    text, spans = loss_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoding["input_ids"][:max_seq_len], dtype=np.int64)
    offsets = np.asarray(encoding["offset_mapping"][:max_seq_len], dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        mask |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
    return ids, mask
