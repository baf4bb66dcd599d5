"""scripts/chat.py with tools: calls shown, run with the demo tools, generation continued to an answer."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dataset import load_tokenizer
from dataset.demo_tools import TOOLS, run_tool
from dataset.formats import parse_row
from model import MiniMindConfig, MiniMindForCausalLM
from scripts._common import prompt_ids
from scripts.chat import MAX_TOOL_ROUNDS, answer_with_tools, fit_context

REPO = Path(__file__).resolve().parents[2]


def call_block(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def scripted(outputs: list[str]):
    """A ``generate`` that returns ``outputs`` in turn and records the history it was given."""
    seen = []

    def generate(messages):
        seen.append(list(messages))
        return outputs[len(seen) - 1], messages

    return generate, seen


def test_calls_are_run_with_the_demo_tools_until_the_model_answers():
    question = [{"role": "system", "content": ""},
                {"role": "user", "content": "What is the lucky number of Lumbria plus the lucky number of Zorlia?"}]
    lookups = call_block("lookup_country", country="Lumbria", field="lucky_number") + "\n" + call_block(
        "lookup_country", country="Zorlia", field="lucky_number")
    generate, seen = scripted([lookups, call_block("calculator", a=48, op="+", b=17), "The result is 65."])
    lines = []
    answer, history = answer_with_tools(generate, question, run_tool, lines.append)

    assert answer == "The result is 65."
    assert lines == [
        'tool call: lookup_country {"country": "Lumbria", "field": "lucky_number"}',
        'tool call: lookup_country {"country": "Zorlia", "field": "lucky_number"}',
        'tool result: {"country": "Lumbria", "lucky_number": 48}',
        'tool result: {"country": "Zorlia", "lucky_number": 17}',
        'tool call: calculator {"a": 48, "op": "+", "b": 17}',
        f'tool result: {run_tool("calculator", {"a": 48, "op": "+", "b": 17})}',
    ]
    assert len(seen) == 3 and seen[0] == question
    # The history the model continues from is the conversation the demo data trains on: the same
    # prompt tokens as the MiniMind-schema row that scripts/make_demo_data.py writes.
    row = {"conversations": [
        {"role": "system", "content": "", "tools": json.dumps(TOOLS, ensure_ascii=False)}, question[1],
        {"role": "assistant", "content": "", "tool_calls": json.dumps(
            [{"name": "lookup_country", "arguments": {"country": "Lumbria", "field": "lucky_number"}},
             {"name": "lookup_country", "arguments": {"country": "Zorlia", "field": "lucky_number"}}])},
        {"role": "tool", "content": '{"country": "Lumbria", "lucky_number": 48}'},
        {"role": "tool", "content": '{"country": "Zorlia", "lucky_number": 17}'},
        {"role": "assistant", "content": "", "tool_calls": json.dumps(
            [{"name": "calculator", "arguments": {"a": 48, "op": "+", "b": 17}}])},
        {"role": "tool", "content": run_tool("calculator", {"a": 48, "op": "+", "b": 17})},
        {"role": "assistant", "content": "The result is 65."},
    ]}
    trained = parse_row(row)
    tokenizer = load_tokenizer(None)
    assert history == trained.messages
    assert prompt_ids(tokenizer, seen[2], TOOLS) == prompt_ids(tokenizer, trained.messages[:-1], trained.tools)


def test_without_tools_the_calls_are_shown_but_not_run():
    generate, seen = scripted([call_block("calculator", a=6, op="*", b=7)])
    lines = []
    answer, history = answer_with_tools(generate, [{"role": "user", "content": "6 * 7?"}], None, lines.append)
    assert (answer, len(seen)) == ("", 1)
    assert lines == ['tool call: calculator {"a": 6, "op": "*", "b": 7}',
                     "(the calls were not run: pass --tools demo to run them with the demo tools)"]
    assert history[-1] == {"role": "assistant", "content": ""}


def test_a_malformed_call_or_endless_calls_stop_with_a_line():
    generate, seen = scripted(['Let me see. <tool_call>\n{"name": "calculator", "arguments": 6 *}\n</tool_call>'])
    lines = []
    answer, _ = answer_with_tools(generate, [{"role": "user", "content": "x"}], run_tool, lines.append)
    assert (answer, len(seen)) == ("Let me see.", 1)
    assert lines == ['tool call not understood (not a JSON name and arguments): {"name": "calculator", "arguments": 6 *}']

    generate, seen = scripted([call_block("calculator", a=1, op="+", b=1)] * MAX_TOOL_ROUNDS)
    lines = []
    answer, history = answer_with_tools(generate, [{"role": "user", "content": "x"}], run_tool, lines.append)
    assert (answer, len(seen)) == ("", MAX_TOOL_ROUNDS)
    assert lines[-1] == f"(stopped: the model was still calling tools after {MAX_TOOL_ROUNDS} rounds)"
    assert lines[:2] == ['tool call: calculator {"a": 1, "op": "+", "b": 1}', f'tool result: {run_tool("calculator", {"a": 1, "op": "+", "b": 1})}']
    assert [m["role"] for m in history] == ["user"] + ["assistant", "tool"] * MAX_TOOL_ROUNDS


def test_a_long_history_loses_whole_exchanges_tool_results_included():
    tokenizer = load_tokenizer(None)
    system = {"role": "system", "content": ""}
    tool_exchange = [
        {"role": "user", "content": "What is 12 times 34?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"a": 12, "op": "*", "b": 34}}}]},
        {"role": "tool", "content": run_tool("calculator", {"a": 12, "op": "*", "b": 34})},
        {"role": "assistant", "content": "408"},
    ]
    last = {"role": "user", "content": "And 2 times 3?"}
    kept = prompt_ids(tokenizer, [system, last], TOOLS)
    full = prompt_ids(tokenizer, [system, *tool_exchange, last], TOOLS)
    assert fit_context(tokenizer, [system, *tool_exchange, last], len(full) + 1, TOOLS) == (
        [system, *tool_exchange, last], full)
    assert fit_context(tokenizer, [system, *tool_exchange, last], len(full), TOOLS) == ([system, last], kept)
    with pytest.raises(ValueError, match=f"the prompt has {len(kept)} tokens; the model's context is {len(kept)}"):
        fit_context(tokenizer, [system, *tool_exchange, last], len(kept), TOOLS)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """An untrained tiny model directory (the generation itself is scripted in the test)."""
    tokenizer = load_tokenizer(None)
    torch.manual_seed(0)
    config = MiniMindConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, max_position_embeddings=512)
    path = tmp_path_factory.mktemp("tiny") / "model"
    MiniMindForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_chat_prompt_with_demo_tools_prints_calls_to_stderr_and_the_answer_to_stdout(tiny_model, monkeypatch, capsys):
    import scripts.chat as chat

    outputs = iter([call_block("lookup_country", country="Lumbria", field="capital"), "Sable"])
    offered = []

    def scripted_generate(model, tokenizer, messages, args, streamer=None, tools=None):
        offered.append(tools)
        return next(outputs), messages

    monkeypatch.setattr(chat, "generate_answer", scripted_generate)
    status = chat.main(["--model_path", str(tiny_model), "--prompt", "What is the capital of Lumbria?",
                        "--tools", "demo", "--temperature", "0", "--device", "cpu"])
    captured = capsys.readouterr()
    assert status == 0 and offered == [TOOLS, TOOLS]
    assert captured.out == "Sable\n"
    assert captured.err == ('tool call: lookup_country {"country": "Lumbria", "field": "capital"}\n'
                            'tool result: {"country": "Lumbria", "capital": "Sable"}\n')


def test_after_the_templates_closed_think_block_the_answer_is_all_the_generated_text(tiny_model, monkeypatch, capsys):
    # thinking off: the prompt ends with an empty think block, so a </think> the model writes is answer text,
    # printed, and kept as text in the history (an empty reasoning_content: the template splits such a content)
    import scripts.chat as chat

    outputs = iter(["I weigh it.</think>\n\nSable", "6"])
    histories = []

    def scripted_generate(model, tokenizer, messages, args, streamer=None, tools=None):
        histories.append(list(messages))
        return next(outputs), messages

    monkeypatch.setattr(chat, "generate_answer", scripted_generate)
    assert chat.main(["--model_path", str(tiny_model), "--prompt", "Capital of Lumbria?", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == "I weigh it.</think>\n\nSable\n"
    typed = iter(["Capital of Lumbria?", "2 times 3?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(typed))
    monkeypatch.setattr(chat, "generate_answer", scripted_generate)
    outputs = iter(["I weigh it.</think>\n\nSable", "6"])
    assert chat.main(["--model_path", str(tiny_model), "--tools", "demo", "--device", "cpu"]) == 0
    assert histories[-1][-2] == {"role": "assistant", "content": "I weigh it.</think>\n\nSable", "reasoning_content": ""}
    tokenizer = load_tokenizer(None)
    assert ("<|im_start|>assistant\n<think>\n\n</think>\n\nI weigh it.</think>\n\nSable<|im_end|>\n"
            in tokenizer.decode(prompt_ids(tokenizer, histories[-1])))  # as the model saw and wrote it


def test_chat_rejects_an_unknown_tool_set():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "chat.py"), "--model_path", "x", "--tools", "web"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: argument --tools: invalid choice: 'web'")
    assert result.stderr.count("\n") == 1


def test_interactive_chat_with_demo_tools_keeps_calls_and_results_in_the_history(tiny_model, monkeypatch, capsys):
    import scripts.chat as chat

    outputs = iter([call_block("lookup_country", country="Lumbria", field="capital"), "Sable",
                    call_block("calculator", a=2, op="*", b=3), "6"])
    histories = []

    def scripted_generate(model, tokenizer, messages, args, streamer=None, tools=None):
        assert streamer is None and tools == TOOLS  # with tools the answer is printed after the calls, not streamed
        histories.append(list(messages))
        return next(outputs), messages

    typed = iter(["What is the capital of Lumbria?", "What is 2 times 3?", "/exit"])
    monkeypatch.setattr(chat, "generate_answer", scripted_generate)
    monkeypatch.setattr("builtins.input", lambda prompt: next(typed))
    assert chat.main(["--model_path", str(tiny_model), "--tools", "demo", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == (
        'tool call: lookup_country {"country": "Lumbria", "field": "capital"}\n'
        'tool result: {"country": "Lumbria", "capital": "Sable"}\n'
        "assistant> Sable\n"
        'tool call: calculator {"a": 2, "op": "*", "b": 3}\n'
        f'tool result: {run_tool("calculator", {"a": 2, "op": "*", "b": 3})}\n'
        "assistant> 6\n")
    lookup = {"name": "lookup_country", "arguments": {"country": "Lumbria", "field": "capital"}}
    assert histories[2] == [
        {"role": "system", "content": ""},
        {"role": "user", "content": "What is the capital of Lumbria?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": lookup}]},
        {"role": "tool", "content": '{"country": "Lumbria", "capital": "Sable"}'},
        {"role": "assistant", "content": "Sable"},
        {"role": "user", "content": "What is 2 times 3?"},
    ]


def test_the_calculator_answers_an_overflow_or_infinity_with_an_error_in_json():
    import json

    for arguments, error in (({"a": 10**400, "op": "*", "b": 1.5}, "the result is too large"),  # OverflowError
                             ({"a": 10**400, "op": "/", "b": 3}, "the result is too large"),
                             ({"a": 1e308, "op": "*", "b": 10}, "the result is too large"),  # inf
                             ({"a": 10**4000, "op": "*", "b": 10**4000}, "the result is too large"),  # > 4300 digits
                             ({"a": float("inf"), "op": "+", "b": 1}, "a must be a finite number, got inf"),
                             ({"a": 1, "op": "-", "b": float("nan")}, "b must be a finite number, got nan")):
        text = run_tool("calculator", arguments)
        assert json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text}")) == {"error": error}
    assert run_tool("calculator", {"a": 48, "op": "+", "b": 17}) == '{"result": 65}'


def test_control_characters_in_the_transcript_are_escaped():
    generate, _ = scripted([call_block("calc\ru\x1b[2J\x07", x=1),
                            "<tool_call>\n{bad\r\x1b[31m\x07}\n</tool_call>"])
    lines = []
    answer_with_tools(generate, [{"role": "user", "content": "x"}], lambda name, arguments: "r\r\x1b[0m\x07", lines.append)
    assert lines == ['tool call: calc\\ru\\x1b[2J\\x07 {"x": 1}', "tool result: r\\r\\x1b[0m\\x07",
                     "tool call not understood (not a JSON name and arguments): {bad\\r\\x1b[31m\\x07}"]


def test_the_models_text_is_printed_with_its_control_characters_escaped(tiny_model, monkeypatch, capsys):
    # a clear-screen, an OSC 52 clipboard write, a bell, a carriage return and a C1 CSI, streamed or not;
    # newlines and tabs are kept
    import scripts.chat as chat

    text = "Hi\x1b[2J\x1b]52;c;aGk=\x07\rthere\n\tend\x9b"
    shown = "Hi\\x1b[2J\\x1b]52;c;aGk=\\x07\\rthere\n\tend\\x9b"
    tokenizer = load_tokenizer(None)

    def scripted_generate(model, tokenizer, messages, args, streamer=None, tools=None):
        if streamer is not None:  # fed as model.generate feeds it: the prompt, then one token at a time
            streamer.put(torch.tensor([prompt_ids(tokenizer, messages)]))
            for token in tokenizer.encode(text, add_special_tokens=False):
                streamer.put(torch.tensor([token]))
            streamer.end()
        return text, messages

    monkeypatch.setattr(chat, "generate_answer", scripted_generate)
    assert chat.main(["--model_path", str(tiny_model), "--prompt", "hi", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == shown + "\n"
    for tools in ([], ["--tools", "demo"]):  # streamed; answered after the calls are run
        typed = iter(["hi", "/exit"])
        monkeypatch.setattr("builtins.input", lambda prompt: next(typed))
        assert chat.main(["--model_path", str(tiny_model), "--device", "cpu", *tools]) == 0
        assert capsys.readouterr().out == "assistant> " + shown + "\n", tools


def test_a_call_the_token_limit_cut_inside_its_closing_tag_is_run():
    # the stop fell inside "</tool_call>": the JSON is whole, so the call is shown and run, as one stopped before the tag
    cut = call_block("calculator", a=2, op="*", b=3)[:-len("_call>")]
    generate, seen = scripted([cut, "6"])
    lines, runs = [], []
    answer = answer_with_tools(generate, [{"role": "user", "content": "2 times 3?"}],
                               lambda name, arguments: runs.append((name, arguments)) or '{"result": 6}', lines.append)
    assert answer[0] == "6" and runs == [("calculator", {"a": 2, "op": "*", "b": 3})]
    assert lines == ['tool call: calculator {"a": 2, "op": "*", "b": 3}', 'tool result: {"result": 6}']
