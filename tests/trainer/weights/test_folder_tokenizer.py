"""trainer/weights/tokenizer.py: a weights folder minisft writes records its tokenizer's fingerprint
(RECORD_FILE), so tokenizer files copied over the folder afterwards are refused by every entry point
that loads the weights with their own tokenizer, not read as theirs; folders without a record load."""

import json
import os
import shutil

import pytest

from dataset import load_tokenizer
from dataset.rendering import DEFAULT_TOKENIZER_DIR
from tests.helpers.overfitted import script_in_process
from tests.helpers.templates import make_alt_tokenizer
from tests.helpers.trainer_launch import flags, run_trainer_in_process
from tests.trainer.test_model_setup import custom_tokenizer, tokenizer_of
from trainer.errors import ModelLoadError
from trainer.weights.inference import load_tokenizer_for_model
from trainer.weights.tokenizer import RECORD_FILE, definition_fingerprint, tokenizer_differences

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    """A tiny run's save_dir (its model/ written by the trainer)."""
    save_dir = tmp_path_factory.mktemp("tokfp") / "run"
    run_trainer_in_process(flags(data, save_dir, "--batch_size", "8", "--max_steps", "1"), check=True)
    return save_dir


def shipped_fingerprint() -> str:
    return definition_fingerprint(load_tokenizer(None))


def copy_of_model(run, folder):
    shutil.copytree(run / "model", folder)
    return folder


def remove_tokenizer(folder) -> None:
    for name in TOKENIZER_FILES:
        if os.path.exists(folder / name):
            os.remove(folder / name)


def replace_tokenizer(folder, source) -> None:
    """`folder`'s tokenizer files replaced by those of the tokenizer directory `source`."""
    remove_tokenizer(folder)
    for name in os.listdir(source):
        shutil.copy(source / name, folder / name)


def test_the_runs_model_and_its_export_record_their_tokenizer_and_load_untouched(run, tmp_path):
    from scripts.export_hf import main as export_main

    record = json.loads((run / "model" / RECORD_FILE).read_text(encoding="utf-8"))
    assert record["tokenizer_fingerprint"] == shipped_fingerprint()
    assert definition_fingerprint(load_tokenizer_for_model(run / "model")) == shipped_fingerprint()
    assert definition_fingerprint(load_tokenizer_for_model(run)) == shipped_fingerprint()
    assert export_main(["--model_path", str(run), "--out_dir", str(tmp_path / "export"), "--format", "qwen3"]) == 0
    assert json.loads((tmp_path / "export" / RECORD_FILE).read_text(encoding="utf-8")) == record


@pytest.mark.parametrize("other", ["template", "vocabulary"])
def test_a_model_folder_whose_tokenizer_files_were_replaced_is_refused_in_one_line(run, data, tmp_path, other):
    """Another run's tokenizer copied over model/: the shipped vocabulary with another chat template, or
    another vocabulary. chat, eval, export (the resolver), chat.py and the trainer's --from_weight refuse it in one
    line; the weights' own tokenizer given as --tokenizer_path is taken; deleting the record accepts it."""
    source = custom_tokenizer(tmp_path / "tok") if other == "template" else make_alt_tokenizer(tmp_path / "tok")
    folder = copy_of_model(run, tmp_path / "model")
    replace_tokenizer(folder, source)
    now = definition_fingerprint(load_tokenizer(source))
    line = (f"{folder}: the tokenizer files in {folder} hold another tokenizer than the weights were saved with "
            f"(fingerprint {shipped_fingerprint()[:16]} in {RECORD_FILE}, {now[:16]} in its files); give "
            "--tokenizer_path DIR with the tokenizer the weights were trained with, or, if these files are meant for the weights, delete "
            f"{folder / RECORD_FILE}")
    with pytest.raises(ModelLoadError) as refused:
        load_tokenizer_for_model(folder)
    assert str(refused.value) == line
    chat = script_in_process("chat.py", "--model_path", str(folder), "--prompt", "hi", "--device", "cpu")
    assert (chat.returncode, chat.stderr, chat.stdout) == (2, f"error: {line}\n", "")
    trainer = run_trainer_in_process(flags(data, tmp_path / "next", "--max_steps", "1", "--from_weight", str(folder)))
    assert (trainer.returncode, trainer.stderr) == (2, f"error: qwen3 model {line}\n")
    assert not os.path.exists(tmp_path / "next" / "model")

    with pytest.raises(ModelLoadError) as refused:
        load_tokenizer_for_model(folder, source)
    assert str(refused.value) == (
        f"--tokenizer_path {source} is not the tokenizer saved with the weights (fingerprint "
        f"{shipped_fingerprint()[:16]}, this one {now[:16]}); give the tokenizer the weights were trained with")

    os.remove(folder / RECORD_FILE)  # the replacement meant: the folder is taken as one without a record
    assert definition_fingerprint(load_tokenizer_for_model(folder)) == now


def inspected(*argv):
    """inspect_data.py's tokenizer for `argv`: (its definition_fingerprint, the lines about it)."""
    from scripts.inspect_data import build_parser, choose_tokenizer

    tokenizer, _, notes = choose_tokenizer(build_parser().parse_args(list(argv)))
    return definition_fingerprint(tokenizer), notes


@pytest.mark.parametrize("damage", ["gone", "replaced"])
def test_the_weights_own_tokenizer_stands_in_for_files_gone_or_replaced_at_every_entry_point(run, tmp_path, damage):
    """The files deleted, or another tokenizer's copied over them: the shipped tokenizer (the weights' own, by
    RECORD_FILE) given as --tokenizer_path is taken by chat, eval, export, the trainer and inspect_data alike,
    with a note that says which of the two happened; inspect_data shows the replaced files given explicitly as
    another tokenizer, as the others refuse them."""
    folder, shipped, explicit = copy_of_model(run, tmp_path / "model"), shipped_fingerprint(), str(DEFAULT_TOKENIZER_DIR)
    if damage == "gone":
        remove_tokenizer(folder)
        fact = (f"the tokenizer files saved with the weights are gone from {folder} ({folder / RECORD_FILE} records "
                "their fingerprint)")
    else:
        source = custom_tokenizer(tmp_path / "tok")
        replace_tokenizer(folder, source)
        now = definition_fingerprint(load_tokenizer(source))
        fact = (f"the tokenizer files in {folder} hold another tokenizer than the weights were saved with (fingerprint "
                f"{shipped[:16]} in {RECORD_FILE}, {now[:16]} in its files)")
    note = f"note: {folder}: {fact}; --tokenizer_path {explicit} has the fingerprint the weights recorded"
    messages = []
    assert definition_fingerprint(load_tokenizer_for_model(folder, explicit, log=messages.append)) == shipped
    assert messages == [note]
    tokenizer, path, messages = tokenizer_of(["--from_weight", str(folder), "--tokenizer_path", explicit,
                                              "--save_dir", str(tmp_path / "next")])
    assert (definition_fingerprint(tokenizer), path) == (shipped, explicit)
    assert messages[-2:] == [f"note: qwen3 model {folder}: {fact}; --tokenizer_path {explicit} has the fingerprint "
                             "the weights recorded", f"tokenizer: {explicit} (--tokenizer_path, {len(tokenizer)} tokens)"]
    assert inspected("--from_weight", str(folder), "--tokenizer_path", explicit) == (shipped, [note])
    if damage == "replaced":
        assert inspected("--from_weight", str(folder), "--tokenizer_path", str(source)) == (now, [
            f"warning: --tokenizer_path {source} differs from the tokenizer saved with --from_weight's weights "
            f"({folder}): fingerprint {now[:16]} against {shipped[:16]} recorded; the weights learned another text "
            "than this data would train (leave --tokenizer_path out to use theirs)", f"note: {folder}: {fact}"])


def truncate(folder) -> None:
    """`folder`'s tokenizer.json cuts every call at 512 tokens: how a call cuts, not what the ids mean."""
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    spec["truncation"] = {"direction": "Right", "max_length": 512, "strategy": "LongestFirst", "stride": 0}
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")


def test_a_tokenizer_that_differs_only_in_truncation_is_the_weights_own_at_every_entry_point(run, tmp_path):
    """definition_fingerprint leaves truncation out, and so does every entry point's check of --tokenizer_path:
    the shipped tokenizer for a folder whose tokenizer.json truncates (its record matches), and that folder's
    tokenizer for the run's model/, are taken without a line, and inspect_data calls them the same; a
    normalizer is another tokenization, refused as that."""
    folder = copy_of_model(run, tmp_path / "model")
    truncate(folder)
    shipped, explicit = shipped_fingerprint(), str(DEFAULT_TOKENIZER_DIR)
    assert load_tokenizer(folder).backend_tokenizer.truncation is not None
    messages = []
    assert definition_fingerprint(load_tokenizer_for_model(folder, explicit, log=messages.append)) == shipped
    assert definition_fingerprint(load_tokenizer_for_model(run / "model", folder, log=messages.append)) == shipped
    assert messages == []
    tokenizer, _, messages = tokenizer_of(["--from_weight", str(folder), "--tokenizer_path", explicit,
                                           "--save_dir", str(tmp_path / "next")])
    assert messages[-1] == f"tokenizer: {explicit} (--tokenizer_path, {len(tokenizer)} tokens)"
    assert not any(message.startswith(("note", "warning")) for message in messages)
    assert inspected("--from_weight", str(folder), "--tokenizer_path", explicit) == (shipped, [
        f"--tokenizer_path {explicit} is the tokenizer saved with --from_weight's weights (same fingerprint)"])

    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    spec["normalizer"] = {"type": "Lowercase"}  # the same vocabulary, other ids for "Hi": another tokenization
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ModelLoadError) as refused:
        load_tokenizer_for_model(run / "model", folder)
    assert str(refused.value) == (
        f"--tokenizer_path {folder} has another tokenization (merges, normalizer, pre-tokenizer or added tokens) than "
        f"the tokenizer saved with the weights ({run / 'model'}); leave --tokenizer_path out to use that one")


def test_tokenizer_differences_name_the_template_and_the_vocabulary_not_truncation(tmp_path):
    mine, theirs = load_tokenizer(None), load_tokenizer(None)
    assert tokenizer_differences(mine, theirs) == []
    theirs.chat_template = theirs.chat_template.replace("# Tools", "# Functions")
    theirs.backend_tokenizer.enable_truncation(512)
    differences = tokenizer_differences(mine, theirs)
    eighth = [tokenizer.chat_template.splitlines()[7].strip()[:60] for tokenizer in (mine, theirs)]
    assert "# Tools" in eighth[0] and differences == [f"chat template (first at line 8: {eighth[0]!r} against {eighth[1]!r})"]
    bigger = load_tokenizer(None)
    bigger.add_tokens(["<extra_token>"])
    assert tokenizer_differences(bigger, mine) == [
        f"vocabulary ({len(mine) + 1} tokens against {len(mine)}; 1 tokens have another id or are missing)"]


def test_a_model_folder_whose_tokenizer_files_are_gone_is_refused_not_given_the_shipped_one(run, tmp_path):
    folder = copy_of_model(run, tmp_path / "model")
    remove_tokenizer(folder)
    with pytest.raises(ModelLoadError) as refused:
        load_tokenizer_for_model(folder)
    assert str(refused.value) == (
        f"{folder}: the tokenizer files saved with the weights are gone from {folder} ({folder / RECORD_FILE} "
        "records their fingerprint); give --tokenizer_path DIR with the tokenizer the weights were trained with")
    assert definition_fingerprint(load_tokenizer_for_model(folder, DEFAULT_TOKENIZER_DIR, log=lambda _: None)) == (
        shipped_fingerprint())


def test_a_folder_without_a_record_loads_its_tokenizer(qwen3_dirs, run, tmp_path):
    """Folders of older runs and of other tools (a Qwen3 saved by transformers) name no fingerprint: their
    tokenizer files are taken as they are."""
    assert not os.path.exists(qwen3_dirs["dense"] / RECORD_FILE)
    assert definition_fingerprint(load_tokenizer_for_model(qwen3_dirs["dense"])) == shipped_fingerprint()
    folder = copy_of_model(run, tmp_path / "model")
    os.remove(folder / RECORD_FILE)
    replace_tokenizer(folder, custom_tokenizer(tmp_path / "tok"))
    assert definition_fingerprint(load_tokenizer_for_model(folder)) == definition_fingerprint(
        load_tokenizer(tmp_path / "tok"))


@pytest.mark.parametrize("text", ["{}\n", '{"tokenizer_fingerprint": "abc"}\n', "not json\n"])
def test_a_damaged_record_is_one_line(run, tmp_path, text):
    folder = copy_of_model(run, tmp_path / "model")
    (folder / RECORD_FILE).write_text(text, encoding="utf-8")
    with pytest.raises(ModelLoadError) as refused:
        load_tokenizer_for_model(folder)
    assert str(refused.value) == (
        f"cannot read {folder / RECORD_FILE}: Expecting value: line 1 column 1 (char 0)" if text == "not json\n" else
        f"{folder / RECORD_FILE}: no tokenizer_fingerprint (64 hex digits) in it: not a record minisft wrote; "
        "delete it to use the folder's tokenizer unchecked")
