"""Helpers shared by the scripts in this folder: argument parsing, device/dtype choice, error exits."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, NoReturn

from trainer.args import HelpFormatter  # the trainer's --help formatter (no torch import)

REPO_DIR = Path(__file__).resolve().parents[1]
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def fail(message: str) -> NoReturn:
    """Print ``error: message`` to stderr and exit with status 2. The line is escaped as the trainer's
    (``dataset.printable``, which imports no torch), newlines too: a file name or value in it cannot
    steer the terminal or split the one line."""
    from dataset.printable import printable

    print(printable(f"error: {message}", one_line=True), file=sys.stderr)
    sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse`` parser whose errors are the one-line ``error: ...`` of the other failures."""

    def __init__(self, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(**kwargs)

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):
        """Parsed, and every flag given a range (`.bounds`, the trainer's where it has the flag) checked;
        `parse_args` parses through this too."""
        from trainer.args import range_problems

        parsed, rest = super().parse_known_args(args, namespace)
        problems = range_problems(self, parsed)
        if problems:
            fail("; ".join(problems))
        return parsed, rest


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model_path --tokenizer_path --device --dtype``, the flags of every script that loads a model."""
    group = parser.add_argument_group("model")
    group.add_argument("--model_path", required=True,
                       help="HF model dir (this model's, or a Qwen3 / Qwen3-MoE one), a MiniMind .pth, a "
                            ".safetensors file, a resume checkpoint .pt, or a run dir (--save_dir of the trainer)")
    group.add_argument("--tokenizer_path", default=None,
                       help="tokenizer dir; default: the one saved with the model, else the shipped one")
    group.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    group.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights dtype for inference")


def check_output_file(path: str | None, flag: str) -> None:
    """Fail at the start, not after the work, when ``flag``'s file ``path`` cannot be written: it is a
    directory, or a file stands where one of its folders would be (missing folders are created)."""
    if not path:
        return
    target = Path(path).absolute()
    if target.is_dir():
        fail(f"{flag} {path} is a directory: give a file name")
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        fail(f"{flag} {path}: {folder} is a file, not a folder")


def check_not_an_input(path: str | None, flag: str, inputs) -> None:
    """Fail when ``flag``'s file ``path`` is one of ``inputs``, the data files the command reads:
    writing the output would destroy them."""
    if not path:
        return
    target = Path(path).resolve()
    for source in inputs:
        if Path(source).resolve() == target:
            fail(f"{flag} {path} is the data file {source}: writing it would overwrite the data; choose another file")


def write_output(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to the file ``path`` a flag names, creating its missing folders."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")


def resolve_device(name: str):
    """``auto`` -> cuda when available, else cpu; a CUDA device that does not exist is an error."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        fail(f"--device {name!r} is not a valid device (use auto, cpu, cuda or cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            fail(f"--device {name}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            fail(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) present")
    elif device.type != "cpu":
        fail(f"--device {name!r} is not supported (use auto, cpu, cuda or cuda:N)")
    return device


def resolve_dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def load_model_and_tokenizer(args):
    """Model (eval mode, on ``args.device`` in ``args.dtype``) and tokenizer from the common flags."""
    from trainer.weights.inference import load_model_for_inference, load_tokenizer_for_model

    device = resolve_device(args.device)
    model = load_model_for_inference(args.model_path, device=device, dtype=resolve_dtype(args.dtype))
    tokenizer = load_tokenizer_for_model(args.model_path, args.tokenizer_path, vocab_size=model.config.vocab_size)
    return model, tokenizer


def is_user_error(error: BaseException) -> bool:
    """Errors that describe bad input (model path, data, tokenizer, a checkpoint or folder that cannot be
    used) rather than a bug: the trainer's user errors and the inference loader's."""
    from trainer.errors import USER_ERRORS, ModelLoadError

    return isinstance(error, (ModelLoadError, *USER_ERRORS))


def run_main(main: Callable[[], int | None]) -> None:
    """Run ``main``; known user errors (bad model/data/paths) become ``error: ...`` and exit 2.

    The error classes are imported only when something failed, so ``--help`` and flag errors
    return without importing torch.
    """
    try:
        status = main()
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(130)
    except OSError as error:
        fail(f"{error.filename or ''}: {error.strerror or error}".lstrip(": "))
    except Exception as error:  # noqa: BLE001 - re-raised unless it is a user error
        if not is_user_error(error):
            raise
        fail(str(error))
    sys.exit(status or 0)


# --------------------------------------------------------------------------- generation


def prompt_ids(tokenizer, messages: list[dict], tools: list | None = None, **template_kwargs) -> list[int]:
    """Token ids of ``messages`` (and ``tools``) rendered with the chat template and the assistant
    generation prompt; text in the messages never becomes special tokens."""
    from dataset.formats import Conversation
    from dataset.rendering import prompt_token_ids

    return prompt_token_ids(tokenizer, Conversation(messages, tools), **template_kwargs)


def generation_kwargs(tokenizer, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """``model.generate`` settings: greedy when ``temperature`` is 0, else nucleus sampling; stop at the
    template's end-of-turn token or eos (``stop_token_ids``)."""
    from trainer.evaluation.evaluate import stop_token_ids

    settings = dict(
        max_new_tokens=max_new_tokens,
        eos_token_id=stop_token_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        do_sample=temperature > 0,
    )
    if temperature > 0:
        settings.update(temperature=temperature, top_p=top_p, top_k=0)
    return settings
