"""dataset/tool_calls.py: generated text split into reasoning, reply and calls; calls compared."""

from dataset.tool_calls import Reply, calls_match, json_equal, parse_reply, prompt_closes_think


def test_a_reply_splits_into_reasoning_text_and_calls():
    text = ("<think>\nweigh it\n</think>\n\nLet me look.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>')
    assert parse_reply(text) == Reply("weigh it", "Let me look.", [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "now", "arguments": {"tz": "UTC"}}])


def test_an_unclosed_think_block_is_all_reasoning():
    assert parse_reply("<think>\nstill thinking") == Reply("still thinking", "")


def test_a_call_that_is_not_json_as_data_must_be_is_a_bad_call_not_its_last_value():
    blocks = ['{"name": "f", "arguments": {"x": 1, "x": 2}}',          # a key twice
              '{"name": "f", "name": "g", "arguments": {}}',
              '{"name": "f", "arguments": "{\\"x\\": 1, \\"x\\": 2}"}',  # twice inside the string
              '{"name": "f", "arguments": {"x": NaN}}',
              '{"name": "f", "arguments": [1]}',
              '{"name": "f", "arguments": {"x": 1}']                      # cut short
    text = "".join(f"<tool_call>\n{block}\n</tool_call>" for block in blocks)
    reply = parse_reply(text)
    assert reply.calls == [] and reply.bad_calls == blocks


def test_calls_match_in_any_order_and_as_json_values():
    reference = [{"name": "a", "arguments": {"n": 1}}, {"name": "b", "arguments": {}}]
    assert calls_match([{"name": "b", "arguments": {}}, {"name": "a", "arguments": {"n": 1.0}}], reference)
    assert not calls_match([{"name": "a", "arguments": {"n": 1}}], reference)
    assert not calls_match([{"name": "a", "arguments": {"n": 1}}, {"name": "a", "arguments": {"n": 1}}], reference)


def test_a_bool_equals_only_a_bool_at_any_depth_in_any_order():
    # JSON true is not the number 1 (Python: True == 1): the demo calculator refuses {"a": true}
    reference = [{"name": "calc", "arguments": {"a": 1, "b": 0, "flags": [{"on": True}], "x": None}},
                 {"name": "calc", "arguments": {"a": 2, "b": 0, "flags": [], "x": None}}]
    right = [{"name": "calc", "arguments": {"a": 2.0, "b": 0, "flags": [], "x": None}},
             {"name": "calc", "arguments": {"a": 1.0, "b": 0.0, "flags": [{"on": True}], "x": None}}]
    assert calls_match(right, reference)
    swaps = [("a", True), ("b", False), ("flags", [{"on": 1}]), ("x", False), ("x", 0), ("flags", [{"on": True}, 1])]
    for key, value in swaps:
        wrong = [right[0], {**right[1], "arguments": {**right[1]["arguments"], key: value}}]
        assert not calls_match(wrong, reference), (key, value)
    assert not json_equal(True, 1) and not json_equal([False], [0]) and not json_equal({"a": 1}, {"a": True})
    assert json_equal({"a": [1, {"b": 2.5}]}, {"a": [1.0, {"b": 2.5}]})
    deep, deeper = [], []
    for _ in range(5000):  # deeper than Python's recursion limit: walked, not recursed
        deep, deeper = [deep], [deeper]
    assert json_equal(deep, deeper)


def test_after_a_closed_think_block_a_think_tag_is_answer_text():
    # the shipped template's generation prompt (thinking off) closes the think block: a </think> the model
    # writes after it is part of the answer, and what precedes it no reasoning
    text = "I weigh it.</think>\n\nSable\n" + '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert parse_reply(text) == Reply("I weigh it.", "Sable", [{"name": "f", "arguments": {}}])
    assert parse_reply(text, think_closed=True) == Reply("", "I weigh it.</think>\n\nSable",
                                                         [{"name": "f", "arguments": {}}])
    assert parse_reply("<think>\nstill", think_closed=True) == Reply("", "<think>\nstill")


def test_a_prompt_closes_the_think_block_where_its_template_writes_an_empty_one():
    from dataset import load_tokenizer
    from tests.helpers.templates import PLAIN_CHATML, QWEN3_TEMPLATE, with_template

    tokenizer = load_tokenizer(None)
    assert prompt_closes_think(tokenizer)  # thinking off: <think>\n\n</think>\n\n
    assert not prompt_closes_think(with_template(tokenizer, QWEN3_TEMPLATE))  # the model opens its own
    assert not prompt_closes_think(with_template(tokenizer, PLAIN_CHATML))
    opened = tokenizer.chat_template.replace("open_thinking is defined and open_thinking", "true")
    assert not prompt_closes_think(with_template(tokenizer, opened))  # <think>\n: the model's reasoning follows


def test_a_call_cut_off_at_the_end_is_a_call_where_its_json_is_whole_else_a_malformed_one():
    # generation stopped at the token limit (anywhere) or at the end-of-turn token (after the JSON, no
    # </tool_call>): a cut inside the JSON is a malformed call, one after it (in the tag too) the call
    call = {"name": "f", "arguments": {"x": [1, "}"]}}
    head, json_text = "Let me look.\n<tool_call>\n", '{"name": "f", "arguments": {"x": [1, "}"]}}'
    whole = head + json_text + "\n</tool_call>"
    for end in range(len(head), len(whole) + 1):
        reply = parse_reply(whole[:end])
        if end < len(head) + len(json_text):
            assert reply.calls == [] and len(reply.bad_calls) == 1, whole[:end]
        else:
            assert (reply.calls, reply.bad_calls) == ([call], []), whole[:end]
        assert reply.content == "Let me look."
