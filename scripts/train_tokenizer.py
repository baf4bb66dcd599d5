"""Train the byte-level BPE tokenizer with ChatML special tokens and save it for transformers.

The saved directory loads with ``transformers.AutoTokenizer.from_pretrained(dir)`` and carries the
shipped chat template (``model/tokenizer/chat_template.jinja``: ChatML with MiniMind's layout for
tools, tool calls, tool responses and think blocks).

Special tokens: ``<|endoftext|>`` (id 0, pad/unk), ``<|im_start|>`` (id 1, bos), ``<|im_end|>``
(id 2, eos). The training text is every message of the given jsonl files plus a deterministic
extra corpus (numbers, letter pairs, CJK characters) so that vocab_size is reached. The
pre-tokenizer is Qwen2's (every digit its own token, so a number copied from a question into a
tool call keeps its tokens), one that llama.cpp implements, so the trained model runs there.
The BPE learns no merge between two CJK characters (``cjk_apart``): Qwen2's pre-tokenizer keeps a
run of Chinese characters whole, and a 6,400-token vocabulary trained on the demo set then
spends itself on whole phrases of its questions ("的首都是什么"), which held-out phrasings split
into pieces the model rarely saw (with such merges the demo model's tool-call accuracy is about
0.2, without them about 0.5). One token per Chinese character keeps question, call and answer in the same pieces.

Usage: python scripts/train_tokenizer.py --out-dir NEW_DIR [--data dataset/demo/sft_train.jsonl ...]
       [--vocab-size 6400]
(``--out-dir`` must be new or empty: a tokenizer is never overwritten in place, the shipped one included.)
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from scripts._common import ArgumentParser, fail, run_main  # noqa: E402
from trainer.weights.gguf import QWEN2_REGEX
from trainer.args import path_value  # noqa: E402

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte is a token of its own (the byte-level alphabet)
CHATML_TEMPLATE = (Path(__file__).resolve().parent.parent / "model" / "tokenizer" / "chat_template.jinja").read_text(
    encoding="utf-8"
)


def iter_jsonl_texts(paths: list[Path], chat_template: str = CHATML_TEMPLATE) -> Iterator[str]:
    """Yield every conversation of MiniMind / ShareGPT / OpenAI data files (read as training reads
    them: .jsonl, .jsonl.gz, .parquet) as the chat template renders it (tools block, think blocks and
    tool calls included), special tokens removed.

    Trained on the rendered text, the fixed parts of the template (role names, the tools
    preamble, ``<tool_call>`` tags, JSON punctuation) become few tokens.
    """
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from dataset.formats import DataError, LineError, decode_line, parse_line
    from dataset.sources import check_data_file, open_lines

    template = _compile_jinja_template(chat_template)
    for path in paths:
        check_data_file(path)  # missing, a directory, empty, ...: one line, as training says it
        for number, line in enumerate(open_lines(path), start=1):  # training's reader: .jsonl, .gz, .parquet
            if not line.strip():
                continue
            try:
                conversation = parse_line(decode_line(line))
                text = template.render(messages=conversation.messages, tools=conversation.tools)
            except LineError as error:
                raise DataError(f"{path}:{number}: {error}") from None
            except Exception as error:  # noqa: BLE001 - the template's raise_exception, a bad role order
                raise DataError(f"{path}:{number}: chat template rejected the conversation ({error})") from None
            for special in SPECIAL_TOKENS:
                text = text.replace(special, "\n")
            yield text


def iter_extra_texts() -> Iterator[str]:
    """Deterministic extra text: numbers 0-999, two-letter ASCII pieces and 3000 CJK characters.

    It only matters after the demo data's own merges: it fills the vocabulary up to vocab_size
    with pieces that keep unseen English / Chinese text reasonably short.
    """
    for n in range(1000):
        yield f"{n} {n}, {n}. {n}\n"
    letters = "abcdefghijklmnopqrstuvwxyz"
    for a in letters:
        for b in letters:
            yield f"{a}{b} {a.upper()}{b.upper()} {a}{b}{a} {a.upper()}{b}"
    yield "".join(chr(0x4E00 + i) for i in range(3000))  # cjk_apart puts each in a pre-token of its own


CJK_CHAR = "[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]"
CJK_PAIR = re.compile(f"({CJK_CHAR})(?={CJK_CHAR})")  # a CJK character followed by another


def cjk_apart(texts: Iterator[str]) -> Iterator[str]:
    """The texts with a newline between adjacent CJK characters: the BPE then learns no merge
    that joins two of them, so a Chinese word is one token per character in any sentence."""
    for text in texts:
        yield CJK_PAIR.sub("\\1\n", text)


def build_tokenizer(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` with the special tokens at ids 0, 1, 2."""
    tokenizer = Tokenizer(models.BPE())
    # Qwen2's pre-tokenizer (llama.cpp knows it as "qwen2", so the model exports to GGUF): words with
    # one leading space or mark, every digit alone, punctuation runs, newline runs.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(cjk_apart(texts), trainer=trainer)
    return tokenizer


def wrap_for_transformers(tokenizer: Tokenizer, chat_template: str = CHATML_TEMPLATE) -> PreTrainedTokenizerFast:
    """Wrap a trained ``tokenizers.Tokenizer`` as a transformers fast tokenizer with ChatML roles."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=PAD_TOKEN,
        chat_template=chat_template,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )


def train_and_save(data_paths: list[Path], out_dir: Path, vocab_size: int = 6400) -> PreTrainedTokenizerFast:
    """Train on the data files plus the extra corpus and save a transformers tokenizer dir."""
    def texts() -> Iterator[str]:
        yield from iter_jsonl_texts(data_paths)
        yield from iter_extra_texts()

    hf_tokenizer = wrap_for_transformers(build_tokenizer(texts(), vocab_size))
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tokenizer.save_pretrained(str(out_dir))
    make_config_portable(out_dir / "tokenizer_config.json", hf_tokenizer.chat_template)
    return hf_tokenizer


def make_config_portable(config_path: Path, chat_template: str) -> None:
    """Let transformers 4.x load the directory too: a class name it knows, the template inline.

    transformers 5 writes ``tokenizer_class: TokenizersBackend`` and the template only to
    ``chat_template.jinja``; ``PreTrainedTokenizerFast`` is the same class under its 4.x name.
    """
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0], prog="train_tokenizer.py")
    parser.add_argument("--data", nargs="+", default=["dataset/demo/sft_train.jsonl"],
                        help="data files as training reads them: .jsonl, .jsonl.gz or .parquet "
                             "(default: dataset/demo/sft_train.jsonl)")
    parser.add_argument("--out-dir", required=True, type=path_value,
                        help="a new or empty directory (the shipped one is model/tokenizer: delete it first to replace it)")
    parser.add_argument("--vocab-size", type=int, default=6400)
    args = parser.parse_args(argv)
    if args.vocab_size < MIN_VOCAB_SIZE:  # the BPE would give MIN_VOCAB_SIZE tokens, not the size asked for
        fail(f"--vocab-size must be >= {MIN_VOCAB_SIZE}, the 256 bytes and {len(SPECIAL_TOKENS)} special tokens "
             f"(got {args.vocab_size})")
    out_dir = Path(args.out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        fail(f"--out-dir {out_dir} exists and is not empty (a tokenizer there would be overwritten): choose a new "
             "directory, or delete that one first to replace it")
    tokenizer = train_and_save([Path(p) for p in args.data], out_dir, args.vocab_size)
    print(f"saved tokenizer with {len(tokenizer)} tokens to {args.out_dir}")
    return 0


if __name__ == "__main__":
    run_main(main)
