"""Chat with a trained MiniMind model: interactive multi-turn (streamed) or one-shot ``--prompt``.

    python scripts/chat.py --model_path out                       # interactive; /reset, /exit
    python scripts/chat.py --model_path out/model --prompt "Hi"   # prints only the answer
    python scripts/chat.py --model_path out/demo --tools demo --prompt "Capital of Lumbria?"

The conversation is rendered with the tokenizer's chat template (``add_generation_prompt=True``)
and generation stops at the eos token (``<|im_end|>``). ``--temperature 0`` is greedy decoding.
After a generation prompt that closes the think block (the shipped template's: thinking off) all of
the generated text is the answer, a ``</think>`` in it included. The model's text is printed, streamed
or not, with its control characters escaped as the transcript lines are (``dataset/printable.py``:
``\\x1b[2J``, ``\\x07``, ``\\r`` shown as such; newlines and tabs kept), so that it cannot clear the
screen, write the clipboard (OSC 52), ring the bell or overwrite a line.

Tool calls the model writes (``<tool_call>`` blocks) are shown as ``tool call: NAME ARGUMENTS``
lines. With ``--tools demo`` the demo tools (``dataset/demo_tools.py``: ``lookup_country``,
``calculator``) are offered to the model in the prompt, each call is run and shown as a
``tool result: ...`` line, the results are appended to the conversation as tool messages and
generation continues, until the model answers in text (at most ``MAX_TOOL_ROUNDS`` rounds). With
``--prompt`` these lines go to stderr and stdout holds only the answer.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._common import (  # noqa: E402
    ArgumentParser, add_model_args, fail, generation_kwargs, load_model_and_tokenizer, prompt_ids, run_main,
)
from trainer.args import flag_bounds  # noqa: E402


# The least sampling temperature: below it sampling is greedy decoding in all but name (a logit 0.1 above the
# next is 22,000 times as likely), and far below it the logits divided by it overflow float32 to inf, which
# sampling cannot draw from (a torch error at the first token).
MIN_TEMPERATURE = 0.01


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[0], prog="chat.py")
    add_model_args(parser)
    parser.add_argument("--prompt", default=None, help="one-shot mode: answer this message, print only the answer")
    parser.add_argument("--system", default=None, help="system prompt placed before the conversation")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help=f"0 = greedy decoding; else at least {MIN_TEMPERATURE}")
    parser.add_argument("--top_p", type=float, default=0.9, help="nucleus sampling mass (sampling only)")
    parser.add_argument("--max_new_tokens", type=int, default=512,
                        help="most tokens generated per answer").bounds = flag_bounds("eval_max_new_tokens")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed for sampling (reproducible answers)").bounds = flag_bounds("seed")
    parser.add_argument("--tools", default="none", choices=["none", "demo"],
                        help="demo = offer the demo tools (lookup_country, calculator) and run the model's calls "
                             "with them until it answers in text; none = show calls without running them")
    return parser


def check_args(args) -> None:
    if not (math.isfinite(args.temperature) and args.temperature >= 0):  # nan would decode greedily, inf uniformly
        fail(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if 0 < args.temperature < MIN_TEMPERATURE:
        fail(f"--temperature must be 0 (greedy decoding) or at least {MIN_TEMPERATURE}, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        fail(f"--top_p must be in (0, 1], got {args.top_p}")


MAX_TOOL_ROUNDS = 5  # generations with tool calls per user message before chat gives up


def fit_context(tokenizer, messages: list[dict], context: int, tools=None) -> tuple[list[dict], list[int]]:
    """Drop the oldest exchanges (a user message with everything up to the next one; never the
    system prompt or the last exchange) until the prompt fits."""
    messages = list(messages)
    ids = prompt_ids(tokenizer, messages, tools)
    while len(ids) >= context:
        first = 1 if messages[0]["role"] == "system" else 0
        later_users = [i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"]
        if not later_users:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {context}")
        del messages[first:later_users[0]]
        ids = prompt_ids(tokenizer, messages, tools)
    return messages, ids


def generate_answer(model, tokenizer, messages: list[dict], args, streamer=None, tools=None) -> tuple[str, list[dict]]:
    """The model's generated text after ``messages`` and the (possibly shortened) history it was given."""
    import torch

    context = model.config.max_position_embeddings
    messages, ids = fit_context(tokenizer, messages, context, tools)
    input_ids = torch.tensor([ids], dtype=torch.long, device=model.device)
    settings = generation_kwargs(tokenizer, min(args.max_new_tokens, context - len(ids)), args.temperature, args.top_p)
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer, **settings)
    answer = tokenizer.decode(output[0, len(ids):], skip_special_tokens=True)
    return answer.strip(), messages


def answer_with_tools(generate, messages: list[dict], run_tool, show,
                      think_closed: bool = False) -> tuple[str, list[dict]]:
    """Generate until the model answers in text, running its tool calls in between.

    ``generate(messages)`` returns ``(generated text, the history it was given)``; ``run_tool(name,
    arguments)`` returns a tool message's text, or is ``None`` (calls are shown, not run); ``show``
    prints one transcript line; ``think_closed``: the generation prompt closes the think block
    (``dataset.tool_calls.prompt_closes_think``), so all of the generated text is answer and calls.
    Returns the answer and the history with the assistant's calls, the tool results and the answer
    appended."""
    from dataset.formats import THINK_CLOSE
    from dataset.printable import printable
    from dataset.tool_calls import parse_reply

    def say(line: str) -> None:  # generated text and tool results may hold control characters
        show(printable(line))

    for _ in range(MAX_TOOL_ROUNDS):
        text, messages = generate(messages)
        reply = parse_reply(text, think_closed)
        message = {"role": "assistant", "content": reply.content}
        # an empty reasoning keeps a </think> of the answer as text (the template splits a content holding one)
        if reply.reasoning or THINK_CLOSE in reply.content:
            message["reasoning_content"] = reply.reasoning
        for block in reply.bad_calls:
            say(f"tool call not understood (not a JSON name and arguments): {block}")
        for call in reply.calls:
            say(f"tool call: {call['name']} {json.dumps(call['arguments'], ensure_ascii=False)}")
        if not reply.calls or reply.bad_calls or run_tool is None:
            if reply.calls and run_tool is None:
                say("(the calls were not run: pass --tools demo to run them with the demo tools)")
            return reply.content, messages + [message]
        message["tool_calls"] = [{"type": "function", "function": call} for call in reply.calls]
        messages = messages + [message]
        for call in reply.calls:
            result = run_tool(call["name"], call["arguments"])
            say(f"tool result: {result}")
            messages.append({"role": "tool", "content": result})
    say(f"(stopped: the model was still calling tools after {MAX_TOOL_ROUNDS} rounds)")
    return "", messages


def escaped_streamer(tokenizer):
    """A ``TextStreamer`` of the generated text (not the prompt) that prints it escaped (``printable``):
    each character is escaped on its own, so a sequence the streamer prints in pieces is escaped whole."""
    from transformers import TextStreamer

    from dataset.printable import printable

    class EscapedStreamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            super().on_finalized_text(printable(text), stream_end)

    return EscapedStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def demo_tools(args) -> tuple[list | None, object]:
    """(the tools offered in the prompt, the function that runs a call) for ``--tools``."""
    if args.tools == "demo":
        from dataset.demo_tools import TOOLS, run_tool

        return TOOLS, run_tool
    return None, None


def interactive(model, tokenizer, args) -> None:
    from dataset.printable import printable
    from dataset.tool_calls import prompt_closes_think

    tools, run_tool = demo_tools(args)
    think_closed = prompt_closes_think(tokenizer)
    system = [{"role": "system", "content": args.system or ""}] if args.system or tools else []
    history = list(system)
    # With tools the answer is printed after the calls are run, not streamed
    streamer = None if tools else escaped_streamer(tokenizer)

    def generate(messages):
        return generate_answer(model, tokenizer, messages, args, streamer, tools)

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
        if streamer is not None:
            print("assistant> ", end="", flush=True)
        try:
            answer, history = answer_with_tools(generate, history + [{"role": "user", "content": text}], run_tool,
                                                print, think_closed)
        except ValueError as error:
            print(f"\nerror: {error}", file=sys.stderr)
            continue
        if streamer is None:
            print(f"assistant> {printable(answer)}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    import torch

    if args.seed is not None:
        torch.manual_seed(args.seed)
    from dataset.printable import printable
    from dataset.tool_calls import prompt_closes_think

    model, tokenizer = load_model_and_tokenizer(args)
    if args.prompt is None:
        interactive(model, tokenizer, args)
        return 0
    tools, run_tool = demo_tools(args)
    messages = [{"role": "system", "content": args.system or ""}] if args.system or tools else []
    messages.append({"role": "user", "content": args.prompt})

    def generate(history):
        return generate_answer(model, tokenizer, history, args, tools=tools)

    try:
        answer, _ = answer_with_tools(generate, messages, run_tool, lambda line: print(line, file=sys.stderr),
                                      prompt_closes_think(tokenizer))
    except ValueError as error:
        fail(str(error))
    print(printable(answer))
    return 0


if __name__ == "__main__":
    run_main(main)
