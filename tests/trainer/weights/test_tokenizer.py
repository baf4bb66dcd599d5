"""trainer/weights/tokenizer.py: every entry point that loads a checkpoint's weights (--from_weight,
chat, eval, export in every format, inspect_data) gets the checkpoint's own tokenizer, checked by the
fingerprint the checkpoint stores."""

import pytest
import torch

from dataset import load_tokenizer
from dataset.rendering import DEFAULT_TOKENIZER_DIR, tokenizer_fingerprint
from tests.helpers.trainer_launch import checkpoint_at, flags, run_trainer_in_process
from tests.trainer.test_model_setup import custom_tokenizer, tokenizer_of
from trainer.errors import ModelLoadError
from trainer.weights.inference import load_tokenizer_for_model


def test_a_checkpoint_keeps_its_runs_tokenizer_and_every_entry_point_loads_it(data, tmp_path):
    gguf = pytest.importorskip("gguf")
    from scripts.export_hf import main as export_main
    from scripts.inspect_data import build_parser, choose_tokenizer

    tok = custom_tokenizer(tmp_path / "tok")  # the shipped vocabulary with another chat template
    run = tmp_path / "run"
    run_trainer_in_process(flags(data, run, "--batch_size", "8", "--max_steps", "1", "--tokenizer_path", str(tok)),
                           check=True)
    theirs = tokenizer_fingerprint(load_tokenizer(tok))
    shipped = tokenizer_fingerprint(load_tokenizer(None))
    state = torch.load(checkpoint_at(run, 1), weights_only=True)
    assert state["tokenizer"]["fingerprint"] == theirs
    # As a run on the default path sees it after model/tokenizer has changed: the recorded directory (None,
    # the shipped one) holds another tokenizer than the run trained with.
    state["args"]["tokenizer_path"] = None
    default = tmp_path / "default.pt"
    torch.save(state, default)
    assert tokenizer_fingerprint(load_tokenizer_for_model(default)) == theirs  # chat, eval, export
    tokenizer, path, _ = tokenizer_of(["--from_weight", str(default), "--save_dir", str(tmp_path / "next")])
    assert tokenizer_fingerprint(tokenizer) == theirs and path is None
    inspected, name, _ = choose_tokenizer(build_parser().parse_args(["--from_weight", str(default)]))
    assert tokenizer_fingerprint(inspected) == theirs  # inspect_data.py --from_weight: what training takes
    assert name == f"the checkpoint's copy of the shipped model/tokenizer (recorded by the resume checkpoint's run, {len(inspected)} tokens)"
    assert export_main(["--model_path", str(default), "--out_dir", str(tmp_path / "gguf"), "--format", "gguf"]) == 0
    reader = gguf.GGUFReader(str(tmp_path / "gguf" / "model-f16.gguf"))
    assert reader.fields["tokenizer.chat_template"].contents() == load_tokenizer(tok).chat_template
    # The run's tokenizer given explicitly is accepted (compared with the checkpoint's fingerprint); the shipped one
    # is refused in one line.
    assert tokenizer_fingerprint(load_tokenizer_for_model(default, tok)) == theirs
    assert tokenizer_fingerprint(tokenizer_of(["--from_weight", str(default), "--tokenizer_path", str(tok)])[0]) == theirs
    with pytest.raises(ModelLoadError) as refused:
        load_tokenizer_for_model(default, DEFAULT_TOKENIZER_DIR)
    assert str(refused.value) == (
        f"--tokenizer_path {DEFAULT_TOKENIZER_DIR} has another chat template or other special tokens than the "
        "tokenizer recorded by the resume checkpoint's run (the shipped model/tokenizer); leave --tokenizer_path "
        "out to use that one")

    # chat / eval / export of the run's model/ with a tokenizer of another chat template: refused as the trainer does
    with pytest.raises(ModelLoadError) as refused:
        load_tokenizer_for_model(run / "model", DEFAULT_TOKENIZER_DIR)
    assert str(refused.value) == (
        f"--tokenizer_path {DEFAULT_TOKENIZER_DIR} has another chat template or other special tokens than the "
        f"tokenizer saved with the weights ({run / 'model'}); leave --tokenizer_path out to use that one")

    # A checkpoint without the copy: the directory it recorded is checked against the fingerprint it recorded.
    del state["tokenizer"]
    older = tmp_path / "older.pt"
    torch.save(state, older)
    with pytest.raises(ModelLoadError) as changed:
        load_tokenizer_for_model(older)
    assert str(changed.value) == (
        f"{older}: the tokenizer its run recorded (the shipped model/tokenizer) has changed since (fingerprint "
        f"{theirs[:16]} recorded, {shipped[:16]} now); give --tokenizer_path DIR with the tokenizer the run trained with")
    assert tokenizer_fingerprint(load_tokenizer_for_model(older, tok)) == theirs
    with pytest.raises(ModelLoadError, match=f"--tokenizer_path {DEFAULT_TOKENIZER_DIR} is not the tokenizer recorded "
                                             f"by the resume checkpoint's run \\(fingerprint {theirs[:16]}, "):
        load_tokenizer_for_model(older, DEFAULT_TOKENIZER_DIR)
