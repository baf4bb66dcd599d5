"""A conversation rendered into a sample (dataset/rendering.py): the tokens and assistant-only loss
mask of the shipped template and of another tokenizer's, a template whose assistant spans cannot be
located, and a sample cut to ``max_seq_len`` (dropped when no loss token is left)."""

import numpy as np
import pytest

from dataset import DataError, build_cache_and_open, load_tokenizer
from tests.helpers.chat_rows import CHAT, make_chat, write_lines
from tests.helpers.templates import make_alt_tokenizer


def test_labels_of_two_turn_chat_with_system_prompt(tokenizer, tmp_path):
    def ids(text):
        return tokenizer.encode(text, add_special_tokens=False)

    start, end, newline = [1], [2], ids("\n")
    ignored = [
        start + ids("system\nBe brief.") + end + newline,
        start + ids("user\nWhat is 2 plus 3?") + end + newline,
        start + ids("assistant\n"),
    ]
    first_reply = ids("<think>\n\n</think>\n\n5") + end
    ignored_between = [newline, start + ids("user\n佐利亚的首都是哪里？") + end + newline, start + ids("assistant\n")]
    second_reply = ids("<think>\n\n</think>\n\n维尔姆") + end
    expected_ids, expected_labels = [], []
    for piece in ignored:
        expected_ids += piece
        expected_labels += [-100] * len(piece)
    expected_ids += first_reply
    expected_labels += first_reply
    for piece in ignored_between:
        expected_ids += piece
        expected_labels += [-100] * len(piece)
    expected_ids += second_reply + newline
    expected_labels += second_reply + [-100] * len(newline)

    ds = build_cache_and_open(write_lines(tmp_path / "a.jsonl", [{"conversations": CHAT}]), tokenizer, 512, num_proc=1)
    item = ds[0]
    assert item["input_ids"].dtype == np.int64 and item["labels"].dtype == np.int64
    assert item["input_ids"].tolist() == expected_ids
    assert item["labels"].tolist() == expected_labels
    assert tokenizer.decode([t for t in item["labels"] if t != -100]) == (
        "<think>\n\n</think>\n\n5<|im_end|><think>\n\n</think>\n\n维尔姆<|im_end|>"
    )


def test_another_tokenizer_and_template_via_path(tmp_path):
    tokenizer_dir = make_alt_tokenizer(tmp_path / "alt_tok")
    data = write_lines(tmp_path / "a.jsonl", [{"conversations": CHAT}])
    ds = build_cache_and_open(data, str(tokenizer_dir), 512, num_proc=1)
    tokenizer = load_tokenizer(tokenizer_dir)
    item = ds[0]
    text = tokenizer.decode(item["input_ids"])
    assert text == (
        "<s>system: Be brief.\n<s>user: What is 2 plus 3?\n<s>Bot: 5</s>\n"
        "<s>user: 佐利亚的首都是哪里？\n<s>Bot: 维尔姆</s>\n"
    )
    labels = [t for t in item["labels"] if t != -100]
    assert tokenizer.decode(labels) == "5</s>维尔姆</s>"
    assert ds.tokens.dtype == np.uint16


def test_template_whose_spans_cannot_be_located_fails_that_line(tmp_path):
    unstable = (  # an assistant turn renders differently when it is not the last message
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + ('<END>' if loop.last else '\n') }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    tokenizer_dir = make_alt_tokenizer(tmp_path / "unstable", template=unstable)
    data = write_lines(tmp_path / "a.jsonl", [{"conversations": CHAT}])
    with pytest.raises(DataError, match=r"a\.jsonl:1: the chat template renders assistant message 3 differently"):
        build_cache_and_open(data, str(tokenizer_dir), 512, num_proc=1)
    with pytest.raises(DataError, match=r"no usable samples \(1 bad lines skipped"):  # a line error: skippable
        build_cache_and_open(data, str(tokenizer_dir), 512, num_proc=1, bad_data="skip")


def test_truncation_drops_samples_without_loss_tokens(tokenizer, tmp_path, capsys):
    long_question = {
        "conversations": [
            {"role": "user", "content": "word " * 200},
            {"role": "assistant", "content": "gone"},
        ]
    }
    partly_cut = {
        "conversations": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help you?"},
            {"role": "user", "content": "word " * 200},
            {"role": "assistant", "content": "gone"},
        ]
    }
    path = write_lines(tmp_path / "long.jsonl", [make_chat(1), long_question, partly_cut])
    ds = build_cache_and_open(path, tokenizer, 64, num_proc=1)
    assert len(ds) == 2 and ds.num_dropped == 1
    assert ds.lengths.tolist()[1] == 64
    kept = ds[1]["labels"]
    assert tokenizer.decode([t for t in kept if t != -100]) == "<think>\n\n</think>\n\nHello! How can I help you?<|im_end|>"
    assert "dropped 1 samples" in capsys.readouterr().out


def test_a_tokenizer_directory_without_tokenizer_json_is_named_in_one_line(tmp_path):
    # transformers' own first line ("Couldn't instantiate the backend tokenizer from one of:") names nothing.
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    (tmp_path / "empty").mkdir()
    for name in ("config_only", "empty"):
        with pytest.raises(DataError) as info:
            load_tokenizer(tmp_path / name)
        assert str(info.value) == (f"{tmp_path / name}: cannot load tokenizer (no tokenizer.json in it, and no fast "
                                   "tokenizer could be built from its other files)")


def test_a_tokenizer_file_given_for_its_directory_is_named_as_a_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError) as info:
        load_tokenizer(tmp_path / "tokenizer.json")
    assert str(info.value) == (f"{tmp_path / 'tokenizer.json'}: is a file; give the tokenizer's directory "
                               f"({tmp_path}, which holds it)")


def test_a_file_in_a_folder_without_a_tokenizer_is_not_called_one_in_a_tokenizers_folder(tmp_path):
    # RUN/checkpoints/step_00000004.pt: its folder holds checkpoints, no tokenizer to point to
    (tmp_path / "step_00000004.pt").write_bytes(b"PK")
    with pytest.raises(DataError) as info:
        load_tokenizer(tmp_path / "step_00000004.pt")
    assert str(info.value) == (f"{tmp_path / 'step_00000004.pt'}: is a file, not a tokenizer directory (a folder "
                               "with tokenizer.json or tokenizer_config.json)")


def test_a_tokenizer_without_pad_and_eos_tokens_is_refused_when_loaded(tmp_path):
    # batches are padded with the pad token (else eos): without both, the trainer would stop in its collator,
    # after tokenizing the data, with "pad_token_id is required"
    import json

    tokenizer = load_tokenizer(None)
    tokenizer.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    for name in ("eos_token", "pad_token", "bos_token", "unk_token"):
        config.pop(name, None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(DataError) as info:
        load_tokenizer(tmp_path)
    assert str(info.value) == (f"{tmp_path}: the tokenizer names neither a pad_token nor an eos_token (batches are "
                               "padded with one): set one in its tokenizer_config.json")


@pytest.mark.parametrize("template, problem", [
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError: unexpected '}'"),
    ("{{ raise_exception('roles must alternate user/assistant/user') }}",
     "TemplateError: roles must alternate user/assistant/user"),
])
def test_a_chat_template_that_cannot_render_an_exchange_is_refused_when_loaded(tmp_path, template, problem):
    # else the template's traceback would stop the trainer (in its end-of-turn probe)
    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(tmp_path))
    with pytest.raises(DataError) as info:
        load_tokenizer(tmp_path)
    assert str(info.value) == f"{tmp_path}: its chat template cannot render a user/assistant exchange ({problem})"
