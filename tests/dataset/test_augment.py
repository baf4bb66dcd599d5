"""MiniMind's two augmentations (dataset/augment.py): the text MiniMind trains on, drawn per seed,
epoch and index, over a cache that does not depend on them."""

from dataset import PackedSFTDataset, build_cache_and_open
from tests.helpers.chat_rows import CALL_TEXT, CHAT, EMPTY_THINK, TOOL_CHAT_MINIMIND, make_chat, write_lines


def test_augmentations_equal_minimind_text_and_are_drawn_per_seed_epoch_index(tokenizer, tmp_path):
    from dataset import ChatAugmenter
    from dataset.augment import SYSTEM_PROMPTS

    rows = [{"conversations": CHAT[1:]}, {"conversations": CHAT}, TOOL_CHAT_MINIMIND]
    path = write_lines(tmp_path / "a.jsonl", rows)
    always = ChatAugmenter(tokenizer, seed=3, system_prompt_ratio=1.0, drop_empty_think_ratio=1.0)
    ds = build_cache_and_open(path, tokenizer, 1024, num_proc=1, augmenter=always)
    prompt = SYSTEM_PROMPTS[always.draw(0, 0)[0]]
    # MiniMind: a system message in front, the rendered text without empty think blocks.
    text = tokenizer.apply_chat_template([{"role": "system", "content": prompt}] + CHAT[1:], tokenize=False)
    item = ds[0]
    assert item["input_ids"].tolist() == tokenizer(text.replace(EMPTY_THINK, ""), add_special_tokens=False)["input_ids"]
    assert tokenizer.decode([t for t in item["labels"] if t != -100]) == "5<|im_end|>维尔姆<|im_end|>"
    text = tokenizer.apply_chat_template(CHAT, tokenize=False).replace(EMPTY_THINK, "")  # has a system prompt
    assert ds[1]["input_ids"].tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    tool_item = ds[2]  # has tools: no system prompt added; the reasoning block stays
    assert tokenizer.decode([t for t in tool_item["labels"] if t != -100]) == (
        f"<think>\nLook it up.\n</think>\n\n{CALL_TEXT}<|im_end|>Velm<|im_end|>"
    )

    many = write_lines(tmp_path / "many.jsonl", [make_chat(i) for i in range(200)])
    half = build_cache_and_open(many, tokenizer, 128, num_proc=1, augmenter=ChatAugmenter(tokenizer, 7, 0.5, 0.5))
    plain = build_cache_and_open(many, tokenizer, 128, num_proc=1)
    assert half.cache.path == plain.cache.path  # the cache does not depend on augmentations
    epoch0 = [half[i]["input_ids"].tolist() for i in range(200)]
    with_system = sum(ids[:3] != plain[i]["input_ids"].tolist()[:3] for i, ids in enumerate(epoch0))
    without_think = sum(len(ids) < len(plain[i]["input_ids"]) + 0 and ids[:3] == plain[i]["input_ids"].tolist()[:3]
                        for i, ids in enumerate(epoch0))
    assert 70 < with_system < 130 and 20 < without_think < 80
    again = build_cache_and_open(many, tokenizer, 128, num_proc=1, augmenter=ChatAugmenter(tokenizer, 7, 0.5, 0.5))
    assert [again[i]["input_ids"].tolist() for i in range(200)] == epoch0
    half.set_epoch(1)
    epoch1 = [half[i]["input_ids"].tolist() for i in range(200)]
    assert sum(a != b for a, b in zip(epoch0, epoch1)) > 50
    packed = PackedSFTDataset(half, 128)
    assert all(len(packed[r]["input_ids"]) <= 128 for r in range(len(packed)))


def test_a_system_prompt_is_added_wherever_it_fits_max_seq_len_with_and_without_packing(tokenizer, tmp_path):
    """A drawn system prompt is added where the sample and the prompt fit in --max_seq_len, also under
    packing (rows are planned with its room), and the start summary counts where it fits."""
    from dataset import ChatAugmenter
    from tests.helpers.bench_launch import demo_head

    always = ChatAugmenter(tokenizer, seed=42, system_prompt_ratio=1.0)
    ds = build_cache_and_open(demo_head(tmp_path, 300), tokenizer, 150, num_proc=1, augmenter=always)
    # 91 samples have no system block (the tool conversations render one for their tools)
    assert always.room_note([ds.prompt_room], 150) == (
        "[data] --system_prompt_ratio 1: 75 of 91 samples without a system prompt have room for one within "
        "--max_seq_len 150, 9 only for the shorter prompts, 7 for none; 86.5% of them get one")
    alone = [ds[i] for i in range(len(ds))]
    assert sum(len(item["input_ids"]) > length for item, length in zip(alone, ds.lengths)) == 80
    packed = PackedSFTDataset(ds, 150)
    for row in range(len(packed)):  # every row holds its samples as they are alone, prompt included
        members = packed.items[packed.row_offsets[row] : packed.row_offsets[row + 1]]
        assert packed[row]["input_ids"].tolist() == [t for i in members for t in alone[i]["input_ids"].tolist()]
        assert len(packed[row]["input_ids"]) <= 150


def test_a_system_block_whose_text_starts_with_a_newline_gets_no_second_one(tokenizer, tmp_path):
    """A system message whose text starts with a newline ("\\nBe brief."), or a MiniMind tool row with
    an empty system message (its block renders "\\n\\n# Tools"): the template's "\\n" after the role and
    the text's newlines are one token ("\\n\\n"), yet the sample has a system block and gets no second
    one in front, as a system prompt without the newline; a sample without one gets it."""
    import json

    from dataset import ChatAugmenter
    from tests.helpers.chat_rows import TOOLS

    reply = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    systems = ["Be brief.", "\nBe brief.", "\n\nBe brief.", "\r\nBe brief."]
    rows = [{"conversations": [{"role": "system", "content": text}] + reply} for text in systems]
    rows.append({"conversations": [{"role": "system", "content": "", "tools": json.dumps(TOOLS)}] + reply})
    path = write_lines(tmp_path / "a.jsonl", rows + [{"conversations": reply}])
    always = ChatAugmenter(tokenizer, seed=0, system_prompt_ratio=1.0)
    ds = build_cache_and_open(path, tokenizer, 256, num_proc=1, augmenter=always)
    for index in range(len(rows)):
        assert ds[index]["input_ids"].tolist() == ds.tokens[ds.offsets[index]:ds.offsets[index + 1]].tolist()
        assert tokenizer.decode(ds[index]["input_ids"]).count("<|im_start|>system") == 1
    assert ds.prompt_room.tolist()[:len(rows)] == [-1] * len(rows)
    prefix = always.prefixes[always.draw(0, len(rows))[0]].tolist()
    assert ds[len(rows)]["input_ids"].tolist() == prefix + ds.tokens[ds.offsets[len(rows)]:].tolist()


def test_dropping_empty_think_blocks_keeps_a_reply_text_that_spells_one(tokenizer, tmp_path):
    """--drop_empty_think_ratio removes the think block each assistant turn opens with, not the same
    characters written in a reply (prose about think tags, trained as written): a turn with reasoning
    keeps its reply whole, and a turn without loses its own empty block only."""
    from dataset import ChatAugmenter

    spelled = "Thinking off:\n" + EMPTY_THINK + "then reply."
    rows = [{"conversations": [{"role": "user", "content": "How?"},
                               {"role": "assistant", "content": spelled, "reasoning_content": "Explain it."}]},
            {"conversations": [{"role": "user", "content": "How?"}, {"role": "assistant", "content": spelled}]}]
    path = write_lines(tmp_path / "a.jsonl", rows)
    ds = build_cache_and_open(path, tokenizer, 256, num_proc=1,
                              augmenter=ChatAugmenter(tokenizer, seed=0, drop_empty_think_ratio=1.0))
    trained = [tokenizer.decode([t for t in ds[i]["labels"] if t != -100]) for i in range(2)]
    assert trained == ["<think>\nExplain it.\n</think>\n\n" + spelled + "<|im_end|>", spelled + "<|im_end|>"]
    from dataset.formats import parse_row
    from dataset.rendering import render

    text = render(tokenizer, parse_row(rows[1]))  # reasoning_content "": the template keeps the content whole
    assert text.count(EMPTY_THINK) == 2
    assert ds[1]["input_ids"].tolist() == tokenizer(text.replace(EMPTY_THINK, "", 1),
                                                   add_special_tokens=False)["input_ids"]


def test_a_sample_whose_only_loss_tokens_are_an_empty_think_block_keeps_it(tokenizer, tmp_path):
    """A sample cut by --max_seq_len right after its first turn's empty think block carries loss on that
    block alone: --drop_empty_think_ratio keeps it there, as a sample without a loss token is never
    trained on; a sample with other loss tokens loses its blocks."""
    from dataset import ChatAugmenter, encode_conversation
    from dataset.formats import parse_row

    row = {"conversations": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red"},
                             {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Blue"}]}
    ids, mask = encode_conversation(tokenizer, parse_row(row), 1024)
    cut = int(mask.argmax()) + 5  # the five tokens of <think>\n\n</think>\n\n
    assert tokenizer.decode(ids[mask.argmax():cut]) == EMPTY_THINK
    path = write_lines(tmp_path / "a.jsonl", [row])
    always = ChatAugmenter(tokenizer, seed=0, drop_empty_think_ratio=1.0)
    short = build_cache_and_open(path, tokenizer, cut, num_proc=1, augmenter=always, cache_dir=tmp_path / "c1")
    assert short[0]["input_ids"].tolist() == ids[:cut].tolist()
    assert tokenizer.decode([t for t in short[0]["labels"] if t != -100]) == EMPTY_THINK
    longer = build_cache_and_open(path, tokenizer, cut + 2, num_proc=1, augmenter=always, cache_dir=tmp_path / "c2")
    assert tokenizer.decode([t for t in longer[0]["labels"] if t != -100]) == "Red"
