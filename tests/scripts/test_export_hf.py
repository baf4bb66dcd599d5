"""scripts/export_hf.py: a remote-code export loads in a fresh process, `--out_dir .`, never into a training run."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from model import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.overfitted import REPO, script, script_in_process
from trainer.weights.inference import load_model_for_inference
from trainer.weights.read import read_weights


FRESH_LOAD = textwrap.dedent("""
    import importlib.util, os, sys, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    assert all(os.path.abspath(p or ".") != sys.argv[3] for p in sys.path), sys.path
    assert importlib.util.find_spec("trainer") is None  # this repo is not importable here
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Sum of 2 and 3?"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    torch.save({"ids": ids, "logits": logits, "module": type(model).__module__}, sys.argv[2])
""")


def test_export_loads_in_a_fresh_process_with_equal_logits(trained, tmp_path):
    out_dir = tmp_path / "export"
    result = script("export_hf.py", "--model_path", str(trained["checkpoint"]), "--out_dir", str(out_dir),
                    "--format", "remote-code")
    assert result.returncode == 0, result.stderr
    names = {p.name for p in out_dir.iterdir()}
    assert {"config.json", "model.safetensors", "configuration_minimind.py", "modeling_minimind.py",
            "packed_attention.py", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "auto_map" in json.loads((out_dir / "config.json").read_text())

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HOME"] = str(tmp_path / "hf_home")
    (tmp_path / "load.py").write_text(FRESH_LOAD)
    fresh = subprocess.run([sys.executable, "load.py", str(out_dir), "fresh.pt", str(REPO)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr
    loaded = torch.load(tmp_path / "fresh.pt", weights_only=True)
    assert loaded["module"].startswith("transformers_modules")  # the exported code, not this repo's
    with torch.no_grad():
        ours = trained["model"](loaded["ids"]).logits
    assert torch.equal(loaded["logits"], ours)

    again = script_in_process("export_hf.py", "--model_path", str(trained["checkpoint"]), "--out_dir", str(out_dir))
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_export_into_the_current_directory(trained, tmp_path):
    """`--out_dir .` (no name of its own) writes into the current directory, which stays the same directory."""
    here = tmp_path / "here"
    here.mkdir()
    inode = here.stat().st_ino
    result = script("export_hf.py", "--model_path", str(trained["checkpoint"]), "--out_dir", ".", cwd=here)
    assert result.returncode == 0, result.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in here.iterdir()}
    assert here.stat().st_ino == inode and sorted(p.name for p in tmp_path.iterdir()) == ["here"]
    assert torch.equal(load_model_for_inference(here).state_dict()["model.norm.weight"],
                       trained["model"].state_dict()["model.norm.weight"])
    again = script_in_process("export_hf.py", "--model_path", str(trained["checkpoint"]), "--out_dir", ".", cwd=here)
    assert again.returncode == 2
    assert again.stderr == f"error: --out_dir {here} is not empty (pass --overwrite to replace it)\n"
    (here / "stale.txt").write_text("from before")
    replaced = script_in_process("export_hf.py", "--model_path", str(trained["checkpoint"]), "--out_dir", ".",
                                 "--overwrite", cwd=here)
    assert replaced.returncode == 0, replaced.stderr
    assert not (here / "stale.txt").exists() and (here / "model.safetensors").is_file()
    assert here.stat().st_ino == inode and sorted(p.name for p in tmp_path.iterdir()) == ["here"]


def test_export_never_writes_into_a_training_run(tmp_path):
    """A run's --save_dir (checkpoints/, metrics.jsonl or .lock) and everything inside it are refused, with or
    without --overwrite, naming the pid of a trainer that holds the run's lock (a real process here)."""
    torch.manual_seed(0)
    source = tmp_path / "source"
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                               num_key_value_heads=2))
    model.save_pretrained(source)
    run = tmp_path / "area" / "run"
    for folder in ("checkpoints", "best", "model"):
        (run / folder).mkdir(parents=True)
    (run / "checkpoints" / "step_00000002.pt").write_bytes(b"resume state")
    (run / "best" / "best.json").write_text("{}")
    model.save_pretrained(run / "model")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}

    def export(out_dir, *extra, run=script_in_process):  # the refusals of export_hf.main, as its __main__ runs it
        return run("export_hf.py", "--model_path", str(source), "--out_dir", str(out_dir), "--overwrite", *extra)

    fresh = tmp_path / "fresh"  # a trainer that has just started: nothing but its lock yet
    fresh.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from trainer.checkpoint.save_dir import SaveDirLock; "
         f"locks = [SaveDirLock(path).acquire() for path in {[str(run), str(fresh)]!r}]; print('locked', flush=True); "
         "sys.stdin.read()"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused = export(fresh, run=script)  # the real command: its exit status and stderr
        assert refused.returncode == 2 and refused.stderr == (
            f"error: --out_dir {fresh} is {fresh}, the --save_dir of a training run in progress (pid {holder.pid}); "
            "export to a directory outside it\n")
        assert os.listdir(fresh) == [".lock"]
        refused = export(run)
        assert refused.returncode == 2 and refused.stderr == (
            f"error: --out_dir {run} is {run}, the --save_dir of a training run in progress (pid {holder.pid}); "
            "export to a directory outside it\n")
        refused = export(run / "checkpoints")
        assert refused.returncode == 2 and refused.stderr.startswith(
            f"error: --out_dir {run / 'checkpoints'} is inside {run}, the --save_dir of a training run in progress "
            f"(pid {holder.pid})")
    finally:
        holder.communicate("", timeout=30)
    cases = {  # the trainer has ended: still its files
        run: f"error: --out_dir {run} is the training run directory {run} (it has checkpoints/ or "
             "metrics.jsonl), whose files an export must not replace; choose a directory outside it\n",
        run / "checkpoints": f"error: --out_dir {run / 'checkpoints'} is inside the training run directory {run} (",
        run / "best": f"error: --out_dir {run / 'best'} is inside the training run's {run / 'best'}, which the run's ",
        run / "new": f"error: --out_dir {run / 'new'} is inside the training run directory {run} (",
        run.parent: f"error: --out_dir {run.parent} holds the training run directory {run}, which --overwrite would "
                    "delete; choose another directory\n",
    }
    for out_dir, message in cases.items():
        refused = export(out_dir)
        assert refused.returncode == 2 and refused.stderr.startswith(message), refused.stderr
        assert refused.stderr.count("\n") == 1
    refused = export(run, "--format", "minimind")
    assert refused.returncode == 2 and refused.stderr.startswith(f"error: --out_dir {run} is the training run directory")
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file() and path.name != ".lock"} == before
    assert (run / ".lock").is_file() and not (run / "new").exists()
    assert sorted(p.name for p in run.parent.iterdir()) == ["run"]  # no staging folder left
    # a model saved at the run's top (what an export into the run would leave) never hides the run's model/
    torch.manual_seed(1)
    MiniMindForCausalLM(model.config).save_pretrained(run)
    for loaded in (load_model_for_inference(run).state_dict(), read_weights(str(run)).state):
        assert torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"],
                           model.state_dict()["model.layers.0.self_attn.q_proj.weight"])


def test_a_minimind_prefix_that_is_a_path_or_empty_is_refused_as_the_trainer_refuses_it(trained, tmp_path):
    """`--save_weight a/b` would write out_dir/a/b_64.pth, `''` a file named `_64.pth`: refused before loading."""
    for prefix in ("a/b", "..", ""):
        done = script_in_process("export_hf.py", "--model_path", str(trained["checkpoint"]), "--format", "minimind",
                                 "--save_weight", prefix, "--out_dir", str(tmp_path / "out"))
        shown = prefix or "''"
        assert (done.returncode, done.stderr) == (2, f"error: --save_weight {shown}: a name for the .pth file inside "
                                                     "--out_dir (e.g. full_sft), not a path\n")
    assert not (tmp_path / "out").exists()


def test_a_flag_of_another_format_is_refused(trained, tmp_path):
    """`--gguf_type q8_0` without `--format gguf` would write a Qwen3 directory, `--save_weight` outside
    minimind would do nothing, and `--dtype` does not set the dtype of a .pth or a GGUF file."""
    for argv, line in ((["--gguf_type", "q8_0"], "error: --gguf_type is a flag of --format gguf, not of --format qwen3"),
                       (["--format", "gguf", "--save_weight", "x"],
                        "error: --save_weight is a flag of --format minimind, not of --format gguf"),
                       (["--format", "gguf", "--dtype", "bfloat16"],
                        "error: --dtype does not apply to --format gguf: --gguf_type sets the tensor type"),
                       (["--format", "minimind", "--dtype", "float32"],
                        "error: --dtype does not apply to --format minimind: its .pth is always float16, "
                        "as MiniMind's own")):
        done = script_in_process("export_hf.py", "--model_path", str(trained["checkpoint"]), *argv,
                                 "--out_dir", str(tmp_path / "out"))
        assert (done.returncode, done.stderr) == (2, line + "\n")
    assert not (tmp_path / "out").exists()


def test_a_gguf_export_with_overwrite_replaces_the_folder_as_every_format_does(trained, tmp_path):
    """--overwrite of a folder that holds another export leaves only the GGUF file, named as the folder."""
    import gguf

    out_dir = tmp_path / "exp"
    assert script_in_process("export_hf.py", "--model_path", str(trained["checkpoint"]), "--out_dir",
                             str(out_dir)).returncode == 0
    export = ["export_hf.py", "--model_path", str(trained["checkpoint"]), "--out_dir", str(out_dir), "--format", "gguf"]
    refused = script_in_process(*export)
    assert (refused.returncode, refused.stderr) == (2, f"error: --out_dir {out_dir} is not empty (pass --overwrite "
                                                       "to replace it)\n")
    replaced = script_in_process(*export, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert replaced.stdout.splitlines()[-1] == f"exported f16 GGUF (qwen3, 6400 tokens) to {out_dir / 'model-f16.gguf'}"
    assert sorted(os.listdir(tmp_path)) == ["exp"] and os.listdir(out_dir) == ["model-f16.gguf"]
    assert gguf.GGUFReader(str(out_dir / "model-f16.gguf")).fields["general.name"].contents() == "exp"


def test_the_files_an_export_stopped_mid_swap_set_aside_are_refused_not_deleted(trained, tmp_path):
    """An export stopped after it moved a folder's files aside (and before it deleted them) leaves them in
    ``.NAME.export-old``, the only copy: the next export into that folder stops with one line and keeps
    them; once that folder is gone, an export writes again (and removes a half-written staging folder)."""
    out_dir = tmp_path / "exp"
    out_dir.mkdir()
    (out_dir / "config.json").write_text("half of the new export")
    old = tmp_path / ".exp.export-old"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"the only copy")
    staging = tmp_path / ".exp.export-tmp"
    staging.mkdir()
    export = ["export_hf.py", "--model_path", str(trained["checkpoint"]), "--out_dir", str(out_dir), "--overwrite"]
    refused = script_in_process(*export)
    assert (refused.returncode, refused.stderr) == (
        2, f"error: an export to {out_dir} was stopped while it swapped the files there, and the old files "
           f"are in {old}: move back what you want to keep, delete {old}, and export again\n")
    assert (old / "model.safetensors").read_bytes() == b"the only copy"
    assert (out_dir / "config.json").read_text() == "half of the new export" and staging.is_dir()
    (old / "model.safetensors").unlink()
    done = script_in_process(*export)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["exp"] and "model.safetensors" in os.listdir(out_dir)


def mount_namespace_available() -> bool:
    """Whether this process may mount a tmpfs in a mount namespace of its own (root, or a user namespace)."""
    try:
        return subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_an_export_into_a_mount_point_stages_inside_it(trained, tmp_path):
    """--out_dir a mount point (a container's volume): nothing renames from its parent into it, so the
    export stages inside it. A first export fills it; with --overwrite a second replaces what it held;
    neither leaves a folder of its own there or beside it. Run in a mount namespace with a tmpfs."""
    if not mount_namespace_available():
        pytest.skip("no mount namespace here (needs root or user namespaces)")
    out_dir = tmp_path / "volume"
    out_dir.mkdir()
    export = f"{sys.executable} scripts/export_hf.py --model_path {trained['checkpoint']} --out_dir {out_dir}"
    steps = [f"mount -t tmpfs tmpfs {out_dir}", export, f"ls -A {out_dir} > {tmp_path}/first",
             f"echo mine > {out_dir}/mine.txt", f"{export} --overwrite", f"ls -A {out_dir} > {tmp_path}/second"]
    done = subprocess.run(["unshare", "-m", "sh", "-ec", " && ".join(steps)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    first, second = ((tmp_path / name).read_text().split() for name in ("first", "second"))
    assert first == second and {"config.json", "model.safetensors", "tokenizer.json"} <= set(first)
    assert not [name for name in first if name.startswith(".")]  # mine.txt replaced, no staging left
    assert sorted(os.listdir(tmp_path)) == ["first", "second", "volume"]
