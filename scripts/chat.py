"""Chat with a trained MiniMind model: interactive multi-turn (streamed) or one-shot ``--prompt``.

    python scripts/chat.py --model_path out                       # interactive; /reset, /exit
    python scripts/chat.py --model_path out/model --prompt "Hi"   # prints only the answer

The conversation is rendered with the tokenizer's chat template (``add_generation_prompt=True``)
and generation stops at the eos token (``<|im_end|>``). ``--temperature 0`` is greedy decoding.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._common import (  # noqa: E402
    ArgumentParser, add_model_args, fail, generation_kwargs, load_model_and_tokenizer, prompt_ids, run_main,
)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[0], prog="chat.py")
    add_model_args(parser)
    parser.add_argument("--prompt", default=None, help="one-shot mode: answer this message, print only the answer")
    parser.add_argument("--system", default=None, help="system prompt placed before the conversation")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy decoding")
    parser.add_argument("--top_p", type=float, default=0.9, help="nucleus sampling mass (sampling only)")
    parser.add_argument("--max_new_tokens", type=int, default=512, help="most tokens generated per answer")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible answers)")
    return parser


def check_args(args) -> None:
    if args.temperature < 0:
        fail(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        fail(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.max_new_tokens < 1:
        fail(f"--max_new_tokens must be positive, got {args.max_new_tokens}")


def fit_context(tokenizer, messages: list[dict], context: int) -> tuple[list[dict], list[int]]:
    """Drop the oldest exchanges (never the system prompt or the last message) until the prompt fits."""
    messages = list(messages)
    ids = prompt_ids(tokenizer, messages)
    while len(ids) >= context:
        first = 1 if messages[0]["role"] == "system" else 0
        if len(messages) - first <= 1:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {context}")
        del messages[first:first + 2]  # one user message and its answer
        ids = prompt_ids(tokenizer, messages)
    return messages, ids


def generate_answer(model, tokenizer, messages: list[dict], args, streamer=None) -> tuple[str, list[dict]]:
    """The model's reply to ``messages`` and the (possibly shortened) history it was given."""
    import torch

    context = model.config.max_position_embeddings
    messages, ids = fit_context(tokenizer, messages, context)
    input_ids = torch.tensor([ids], dtype=torch.long, device=model.device)
    settings = generation_kwargs(tokenizer, min(args.max_new_tokens, context - len(ids)), args.temperature, args.top_p)
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer, **settings)
    answer = tokenizer.decode(output[0, len(ids):], skip_special_tokens=True)
    return answer.strip(), messages


def interactive(model, tokenizer, args) -> None:
    from transformers import TextStreamer

    system = [{"role": "system", "content": args.system}] if args.system else []
    history = list(system)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    print("Chat with the model. Commands: /reset (new conversation), /exit (or Ctrl-D).", file=sys.stderr)
    while True:
        try:
            text = input("\nuser> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            history = list(system)
            print("(conversation reset)", file=sys.stderr)
            continue
        print("assistant> ", end="", flush=True)
        try:
            messages = history + [{"role": "user", "content": text}]
            answer, history = generate_answer(model, tokenizer, messages, args, streamer)
        except ValueError as error:
            print(f"\nerror: {error}", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": answer})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    import torch

    if args.seed is not None:
        torch.manual_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer(args)
    if args.prompt is None:
        interactive(model, tokenizer, args)
        return 0
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    try:
        answer, _ = generate_answer(model, tokenizer, messages, args)
    except ValueError as error:
        fail(str(error))
    print(answer)
    return 0


if __name__ == "__main__":
    run_main(main)
