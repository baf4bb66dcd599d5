"""Tokenizer loading and chat rendering with assistant-only loss masks, for any HF chat template.

The conversation (messages and its ``tools``) is rendered once, with the tokenizer's own chat
template; that one text is what is trained on. Each assistant message's loss span is then
located in it, without assuming that rendering a prefix of the conversation gives a prefix of
the text (templates that put ``<think>\n\n</think>\n\n`` into the generation prompt, or that
drop the reasoning of earlier turns, are not prefix-stable). For assistant message ``i``:

* ``fragment``: how the template renders that message as the last one (``messages[:i + 1]``
  minus what ``messages[:i]`` renders), without trailing whitespace: header, think block, reply,
  tool calls and end-of-turn token (``<|im_end|>``).
* ``header``: the part of the fragment that the generation prompt (and a probe reply) share with
  it, cut before a ``<think>`` tag: ``<|im_start|>assistant\n`` for ChatML. The think block is
  learned with its tags, so a model learns to open and close it.
* The header is searched in the full text from where the previous span ended (and no earlier
  than where the text of ``messages[:i]`` stops matching); the turn's is the first one that the
  fragment (or its body, below) follows, and the span ``[start of fragment + len(header), end of
  fragment)`` carries loss. The first such header, not the first copy of the fragment: a later
  turn can render as this one's fragment (Qwen3 writes an empty think block into the last turn
  only, so an earlier turn with the same reply, as the last message, renders as the last one).
* A template that renders an earlier turn differently (Qwen3-style templates drop its think
  block) does not put the fragment after its header: then the fragment's body (what follows its
  think block: reply, tool calls, end-of-turn token) is searched after the header, with no header
  between them; the span runs from the header's end to the body's end, so whatever think block
  the template left is learned too. A header that neither follows (one that data spells) is passed
  over; a turn that cannot be found makes that line bad (``LineError``, skippable). A template
  whose header is empty: the first copy of the fragment.

A token carries loss when its characters overlap a span (fast-tokenizer offsets), so a token that
merges a header's trailing space with the reply's first word is learned, as in HF's
``return_assistant_tokens_mask``.

What the data carries must be in the text: a conversation whose tools, tool calls or reasoning the
template leaves out (a plain ChatML template renders only roles and contents) makes that line bad
(``LineError``, skippable), rather than training a call turn as an empty reply. A string counts as
rendered where it occurs more often than in the data the template writes there verbatim, as written
or as inside a JSON string (``tojson``, with or without ``ensure_ascii``):

* a tool: its function name, outside the loss spans, beyond the system, user and tool messages'
  contents (a tool without a name: each of its strings);
* a tool call: its function name and every key and string value of its arguments, in its turn's
  loss span, beyond the turn's reply and the reasoning rendered there;
* reasoning (``reasoning_content``): in its turn's loss span, beyond the reply, for a turn that no
  user message follows. An earlier turn's reasoning need only be in its ``fragment`` (rendered when
  the turn is the last message): Qwen3's templates leave the reasoning of turns before the last
  user message out of the text by design (the model never sees it in a later prompt), so that
  reasoning is learned only by a row that ends with it.

Special tokens come only from the template: text inside the data that spells a special token
(``<|im_end|>`` in a user turn, in a key of a tool call's arguments or of a tool's schema) is
tokenized as plain text, so data cannot forge turns.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .formats import THINK_CLOSE, THINK_OPEN, Conversation, DataError, LineError, first_line
from .prefix_tokens import encode_text

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "model" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a folder holding one holds a tokenizer


def load_tokenizer(path: str | Path | None = None):
    """Load a fast HF tokenizer with a chat template (``None``: the shipped ``model/tokenizer``).

    Raises a one-line ``DataError`` if the directory is missing, cannot be loaded, is not a fast
    tokenizer (offsets are needed), has no chat template or one that cannot render a plain exchange,
    or names neither a pad nor an eos token. A tokenizer without a pad token gets its eos token as
    pad token (pads never carry loss).
    """
    from transformers import AutoTokenizer

    directory = Path(path) if path is not None else DEFAULT_TOKENIZER_DIR
    if directory.is_file():  # transformers loads a folder
        if holds_tokenizer(directory.parent):  # tokenizer.json itself, say
            raise DataError(f"{directory}: is a file; give the tokenizer's directory ({directory.parent}, which holds it)")
        raise DataError(f"{directory}: is a file, not a tokenizer directory (a folder with {' or '.join(TOKENIZER_FILES)})")
    if not directory.is_dir():
        raise DataError(f"{directory}: tokenizer directory not found")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # noqa: BLE001 - any loading failure becomes one line
        message = first_line(exc)
        if not (directory / "tokenizer.json").is_file():  # transformers' first line then ends in "from one of:"
            message = "no tokenizer.json in it, and no fast tokenizer could be built from its other files"
        raise DataError(f"{directory}: cannot load tokenizer ({message})") from None
    check_tokenizer(tokenizer, str(directory))
    _check_template_renders(tokenizer, str(directory))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise DataError(f"{directory}: the tokenizer names neither a pad_token nor an eos_token (batches are "
                            "padded with one): set one in its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def holds_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def check_tokenizer(tokenizer, name: str = "tokenizer") -> None:
    """Raise ``DataError`` unless ``tokenizer`` is a fast tokenizer with a chat template."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{name}: a fast tokenizer is required (character offsets are used for loss masks)")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{name}: tokenizer has no chat_template")


def _check_template_renders(tokenizer, name: str) -> None:
    """A chat template's syntax error or ``raise_exception`` on a plain user/assistant exchange is one
    line when the tokenizer is loaded, not a traceback from wherever the template is first used."""
    exchange = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        tokenizer.apply_chat_template(exchange, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - jinja's syntax and template errors, each its own class
        raise DataError(f"{name}: its chat template cannot render a user/assistant exchange "
                        f"({type(exc).__name__}: {first_line(exc)})") from None


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of everything that changes token ids: vocab/merges/special tokens/normalizer and the template.

    Uses the serialized backend (``tokenizer.json`` content), so it needs no encoding call. Its
    truncation and padding settings are left out: they change no token id of ours (every call
    passes none, and the call clears those a ``tokenizer.json`` saved), and counting them would give
    a tokenizer loaded with them another fingerprint than the same tokenizer after its first call.
    ``split_special_tokens`` is counted where a tokenizer is saved with it set: it is that
    tokenizer's default for every call and changes what ``tokenizer(text)`` gives (the chat markers
    a template writes stay special tokens in our calls, which pass ``False`` for them).
    """
    digest = hashlib.sha256()
    digest.update(_backend_text(tokenizer.backend_tokenizer).encode("utf-8"))
    template = tokenizer.chat_template
    digest.update(json.dumps(template, sort_keys=True).encode("utf-8"))
    specials = {name: str(getattr(tokenizer, name, None)) for name in ("bos_token", "eos_token", "pad_token")}
    digest.update(json.dumps(specials, sort_keys=True).encode("utf-8"))
    digest.update(type(tokenizer).__name__.encode("utf-8"))
    if getattr(tokenizer, "split_special_tokens", False):
        digest.update(b"split_special_tokens")
    return digest.hexdigest()


def _backend_text(backend) -> str:
    """The backend's serialization with no truncation and no padding (as after a tokenizer call)."""
    if backend.truncation is None and backend.padding is None:
        return backend.to_str()
    bare = Tokenizer.from_str(backend.to_str())
    bare.no_truncation()
    bare.no_padding()
    return bare.to_str()


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned integer dtype that holds ids ``0 .. vocab_size - 1``."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


def render(tokenizer, conversation: Conversation, add_generation_prompt: bool = False, **template_kwargs) -> str:
    """The conversation as text, through the tokenizer's chat template (``tools=`` passed)."""
    return _render(tokenizer, conversation.messages, conversation.tools, add_generation_prompt, **template_kwargs)


def _render(tokenizer, messages: list[dict], tools, add_generation_prompt: bool = False, **template_kwargs) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except Exception as exc:  # noqa: BLE001 - e.g. a template's raise_exception on role order
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LineError(f"chat template rejected the conversation ({message})") from None


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (slice comparisons, halving the range: no Python loop
    over characters)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    same, differ = 0, n  # a[:same] == b[:same]; a[:differ] != b[:differ]
    while differ - same > 1:
        middle = (same + differ) // 2
        if a[same:middle] == b[same:middle]:
            same = middle
        else:
            differ = middle
    return same


PROBE = "\ue000"  # a private-use character no template emits: marks where a reply's text begins


def _assistant_fragment(tokenizer, messages, tools, index: int, message: dict, before: str) -> tuple[str, int]:
    """(fragment of ``message`` rendered as message ``index``, header length); ``before`` is the
    rendering of ``messages[:index]``. See the module docstring."""
    rendered = _render(tokenizer, messages[:index] + [message], tools)
    fragment = rendered[_common_prefix(before, rendered) :].rstrip()
    prompt = _render(tokenizer, messages[:index], tools, add_generation_prompt=True)
    generation = prompt[_common_prefix(before, prompt) :]
    probed = _render(tokenizer, messages[:index] + [{"role": "assistant", "content": PROBE}], tools)
    probe = probed[_common_prefix(before, probed) :]
    header = min(_common_prefix(fragment, generation), _common_prefix(fragment, probe))
    think = fragment.find(THINK_OPEN, 0, header + len(THINK_OPEN))
    if 0 <= think < header:
        header = think
    return fragment, header


def _body(fragment: str, header: int) -> str:
    """What follows the think block of a fragment: reply, tool calls, end-of-turn token."""
    rest = fragment[header:]
    if rest.startswith(THINK_OPEN) and THINK_CLOSE in rest:
        rest = rest.split(THINK_CLOSE, 1)[1].lstrip("\n")
    return rest


def _locate(text: str, fragment: str, header: int, lower: int) -> tuple[int, int] | None:
    """The loss span of a fragment in the full text (see the module docstring), or ``None``."""
    head, body = fragment[:header], _body(fragment, header)
    if not head:
        position = text.find(fragment, lower)
        return (position, position + len(fragment)) if position >= 0 else None
    position = text.find(head, lower)
    while position >= 0:
        start = position + len(head)
        if text.startswith(fragment, position):
            return start, position + len(fragment)
        end = text.find(body, start) if body else -1
        if end >= 0 and head not in text[start:end]:  # the body belongs to this header's turn
            return start, end + len(body)
        position = text.find(head, start)
    return None


def _forms(needle: str):
    """``needle`` as a template writes it: as it is, or inside a JSON string (``tojson``)."""
    yield needle
    for ascii_only in (False, True):
        form = json.dumps(needle, ensure_ascii=ascii_only)[1:-1]
        if form != needle:
            yield form


def _rendered(needle: str, text: str, verbatim: list[str]) -> bool:
    """Does ``text`` hold ``needle`` more often than the data strings ``verbatim`` that it holds as they
    are: an occurrence beyond theirs is the template's rendering of it (module docstring)."""
    return any(text.count(form) > sum(string.count(form) for string in verbatim) for form in _forms(needle))


def _left_out(message: dict, number: int, fragment: str, trained: str, answered: bool):
    """(what, detail) of each part of assistant message ``number`` that its loss span's text ``trained``
    lacks (``fragment``, for the reasoning of a turn that a user message follows: ``answered``)."""
    content = message.get("content")
    verbatim = [content if isinstance(content, str) else ""]
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning.strip():
        if not _rendered(reasoning.strip(), fragment if answered else trained, verbatim):
            yield "reasoning", f"assistant message {number}"
        elif _rendered(reasoning.strip(), trained, verbatim):
            verbatim.append(reasoning)
    for call in message.get("tool_calls") or ():
        function = call.get("function") or call
        needles = [function.get("name"), *data_strings(function.get("arguments"))]
        if not all(_rendered(needle, trained, verbatim) for needle in needles if isinstance(needle, str) and needle):
            yield "tool calls", f"assistant message {number}: {function.get('name')!r}"


def _tools_left_out(conversation: Conversation, text: str, spans: list[tuple[int, int]]):
    """("tools", name) of each tool that the text outside the loss spans lacks (module docstring)."""
    bounds = [0, *(bound for span in spans for bound in span), len(text)]
    outside = "\x00".join(text[start:end] for start, end in zip(bounds[0::2], bounds[1::2]))
    verbatim = [message["content"] for message in conversation.messages
                if message["role"] != "assistant" and isinstance(message.get("content"), str)]
    for tool in conversation.tools or ():
        function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = function.get("name")
        needles = [name] if isinstance(name, str) and name else [string for string in data_strings(tool) if string]
        if not all(_rendered(needle, outside, verbatim) for needle in needles):
            yield "tools", repr(name) if isinstance(name, str) and name else "one without a name"


def _not_rendered(tokenizer, missing: dict[str, str]) -> LineError:
    """The line's error naming the first of each part the template left out."""
    parts = [f"{what} ({missing[what]})" for what in ("tools", "tool calls", "reasoning") if what in missing]
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    where = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    return LineError(f"the chat template of {where} does not render this conversation's {listed}")


def loss_spans(tokenizer, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation; return the text and the character spans that carry loss. A
    conversation whose tools, tool calls or reasoning the text lacks is a ``LineError`` (module docstring)."""
    messages, tools = conversation.messages, conversation.tools
    text = _render(tokenizer, messages, tools)
    spans = []
    cursor = 0
    missing: dict[str, str] = {}  # what the template left out -> where, first
    last_user = max((index for index, message in enumerate(messages) if message["role"] == "user"), default=-1)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if index == 0:
            raise LineError("conversation starts with an assistant message")
        before = _render(tokenizer, messages[:index], tools)
        lower = max(cursor, _common_prefix(text, before))
        fragment, header = _assistant_fragment(tokenizer, messages, tools, index, message, before)
        span = _locate(text, fragment, header, lower)
        if span is None:
            raise LineError(
                f"the chat template renders assistant message {index + 1} differently inside the conversation "
                "than as its last message; its loss span cannot be located"
            )
        for what, detail in _left_out(message, index + 1, fragment, text[span[0]:span[1]], index < last_user):
            missing.setdefault(what, detail)
        if span[1] > span[0]:
            spans.append(span)
        cursor = span[1]
    for what, detail in _tools_left_out(conversation, text, spans):
        missing.setdefault(what, detail)
    if missing:
        raise _not_rendered(tokenizer, missing)
    return text, spans


def special_token_texts(tokenizer) -> list[str]:
    """The strings the tokenizer turns into special tokens (``<|im_start|>``, ...)."""
    return sorted({token.content for token in tokenizer.added_tokens_decoder.values() if token.special}, key=len, reverse=True)


def data_strings(value):
    """Every string inside ``value`` (nested dicts and lists), the dicts' keys included: a key of a
    tool call's arguments or a tool's schema is rendered as data too."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from data_strings(key)
            yield from data_strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from data_strings(item)


def _mask_specials(value, specials: list[str]):
    """``value`` with every special-token text in its strings (keys too) replaced by same-length filler."""
    if isinstance(value, str):
        for special in specials:
            value = value.replace(special, PROBE * len(special))
        return value
    if isinstance(value, dict):
        return {_mask_specials(key, specials): _mask_specials(item, specials) for key, item in value.items()}
    if isinstance(value, list):
        return [_mask_specials(item, specials) for item in value]
    return value


def template_special_positions(
    tokenizer, conversation: Conversation, text: str, **render_kwargs
) -> list[tuple[int, str]] | None:
    """Where the template (not the data) put special tokens in ``text`` (rendered with
    ``render_kwargs``); ``None`` if the data spells none."""
    specials = special_token_texts(tokenizer)
    data = [conversation.messages, conversation.tools]
    if not any(special in string for string in data_strings(data) for special in specials):
        return None
    masked = Conversation(_mask_specials(conversation.messages, specials), _mask_specials(conversation.tools, specials))
    masked_text = render(tokenizer, masked, **render_kwargs)
    if len(masked_text) != len(text):
        raise LineError("the data contains special-token text that the chat template transforms; it cannot be tokenized as text")
    positions = []
    start = 0
    while start < len(masked_text):
        found = [(masked_text.find(special, start), special) for special in specials]
        found = [(position, special) for position, special in found if position >= 0]
        if not found:
            break
        position, special = min(found, key=lambda item: (item[0], -len(item[1])))
        positions.append((position, special))
        start = position + len(special)
    return positions


def tokenize_rendered(
    tokenizer, conversation: Conversation, text: str, max_tokens: int | None = None, **render_kwargs
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of ``text`` = ``render(tokenizer, conversation, **render_kwargs)``;
    special tokens only where the template put them. ``max_tokens``: at least the first that many
    (``prefix_tokens``: a long text is not tokenized to its end)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LineError(f"text contains {text[exc.start]!r}, a lone surrogate that is not valid Unicode") from None
    positions = template_special_positions(tokenizer, conversation, text, **render_kwargs)
    if positions is None:
        return encode_text(tokenizer, text, max_tokens)
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    cursor = 0
    for position, special in positions + [(len(text), None)]:
        if max_tokens is not None and len(ids) >= max_tokens:
            break
        if position > cursor:
            left = None if max_tokens is None else max_tokens - len(ids)
            piece_ids, piece_offsets = encode_text(tokenizer, text[cursor:position], left, split_special_tokens=True)
            ids += piece_ids
            offsets += [(cursor + a, cursor + b) for a, b in piece_offsets]
        if special is not None:
            ids.append(tokenizer.convert_tokens_to_ids(special))
            offsets.append((position, position + len(special)))
        cursor = position + (len(special) if special else 0)
    return ids, offsets


def as_conversation(conversation) -> Conversation:
    return conversation if isinstance(conversation, Conversation) else Conversation(list(conversation))


def prompt_token_ids(tokenizer, conversation, **template_kwargs) -> list[int]:
    """Token ids of the conversation plus the generation prompt (``template_kwargs`` such as
    ``open_thinking=True`` go to the template); special tokens only from the template."""
    conversation = as_conversation(conversation)
    text = render(tokenizer, conversation, add_generation_prompt=True, **template_kwargs)
    return tokenize_rendered(tokenizer, conversation, text, add_generation_prompt=True, **template_kwargs)[0]


def span_mask(offsets: np.ndarray, spans) -> np.ndarray:
    """Which tokens carry loss: those whose characters (``offsets``, int64 (n, 2)) overlap a span."""
    mask = np.zeros(len(offsets), dtype=bool)
    for start, end in spans:
        mask |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
    return mask


def encode_with_template(tokenizer, conversation: Conversation, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The general path behind ``tokens.encode_conversation``, for any chat template: token ids
    (int64) and loss mask (bool) of one conversation, truncated to ``max_seq_len``."""
    text, spans = loss_spans(tokenizer, conversation)
    token_ids, token_offsets = tokenize_rendered(tokenizer, conversation, text, max_tokens=max_seq_len)
    ids = np.asarray(token_ids[:max_seq_len], dtype=np.int64)
    offsets = np.asarray(token_offsets[:max_seq_len], dtype=np.int64).reshape(-1, 2)
    return ids, span_mask(offsets, spans)
