"""Inference loading and the user scripts (chat, eval, export, plot) on a tiny overfitted model."""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dataset import SFTCollator, encode_conversation, load_tokenizer
from model import MiniMindConfig, MiniMindForCausalLM
from trainer.errors import ModelLoadError
from trainer.weights.inference import load_model_for_inference, load_tokenizer_for_model
from trainer.weights.read import read_weights

REPO = Path(__file__).resolve().parents[2]
CONVERSATIONS = [
    [{"role": "system", "content": "You are a geography bot."},
     {"role": "user", "content": "What is the capital of Zorlia?"},
     {"role": "assistant", "content": "Velm"}],
    [{"role": "user", "content": "Sum of 2 and 3?"},
     {"role": "assistant", "content": "5"}],
    [{"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Hi there!"},
     {"role": "user", "content": "Flag colour of Quendor?"},
     {"role": "assistant", "content": "blue"}],
]


def script(name: str, *args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def greedy(model, tokenizer, messages) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model overfitted on CONVERSATIONS, saved as a run dir, an HF dir, a .pt and a .safetensors."""
    root = tmp_path_factory.mktemp("trained")
    tokenizer = load_tokenizer(None)
    torch.manual_seed(0)
    config = MiniMindConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=512)
    model = MiniMindForCausalLM(config)
    items = []
    for messages in CONVERSATIONS:
        ids, mask = encode_conversation(tokenizer, messages, 512)
        items.append({"input_ids": ids, "labels": np.where(mask, ids, -100)})
    batch = SFTCollator(pad_token_id=tokenizer.pad_token_id)(items)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(100):
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()
    model.eval()
    for messages in CONVERSATIONS:
        assert greedy(model, tokenizer, messages[:-1]) == messages[-1]["content"]

    run_dir = root / "run"
    model.save_pretrained(run_dir / "model")
    tokenizer.save_pretrained(run_dir / "model")
    checkpoint = run_dir / "checkpoints" / "step_00000060.pt"
    checkpoint.parent.mkdir(parents=True)
    torch.save({"format": "minisft-resume", "format_version": 1, "model_config": config.to_dict(),
                "model": model.state_dict(), "step": 60, "args": {"tokenizer_path": None}}, checkpoint)
    loose = root / "loose"
    loose.mkdir()
    (loose / "config.json").write_text((run_dir / "model" / "config.json").read_text())
    weights = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, loose / "weights.safetensors")
    data = root / "conversations.jsonl"
    data.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in CONVERSATIONS), encoding="utf-8")
    return {"model": model, "tokenizer": tokenizer, "run_dir": run_dir, "hf_dir": run_dir / "model",
            "checkpoint": checkpoint, "safetensors": loose / "weights.safetensors", "data": data, "root": root}


# --------------------------------------------------------------------------- loading


@pytest.mark.parametrize("kind", ["run_dir", "hf_dir", "checkpoint", "safetensors"])
def test_every_path_kind_loads_the_same_weights(trained, kind):
    loaded = load_model_for_inference(trained[kind])
    assert not loaded.training
    expected = trained["model"].state_dict()
    state = loaded.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert load_tokenizer_for_model(trained[kind]).chat_template == trained["tokenizer"].chat_template


def test_tokenizer_comes_from_the_checkpoint_args(trained, tmp_path):
    tokenizer_dir = tmp_path / "tok"
    trained["tokenizer"].save_pretrained(tokenizer_dir)
    state = torch.load(trained["checkpoint"], weights_only=True)
    state["args"]["tokenizer_path"] = str(tokenizer_dir)
    torch.save(state, tmp_path / "step.pt")
    assert Path(load_tokenizer_for_model(tmp_path / "step.pt").name_or_path) == tokenizer_dir
    assert Path(load_tokenizer_for_model(trained["hf_dir"]).name_or_path) == trained["hf_dir"]


class Malicious:
    marker = None

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_bad_files_raise_one_line_model_load_errors(trained, tmp_path):
    good = trained["checkpoint"].read_bytes()
    (tmp_path / "truncated.pt").write_bytes(good[: len(good) // 2])
    (tmp_path / "zeros.pt").write_bytes(bytes(4096))
    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    marker = tmp_path / "PWNED"
    Malicious.marker = str(marker)
    torch.save({"format": "minisft-resume", "model": Malicious()}, tmp_path / "evil.pt")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 100)
    (tmp_path / "config.json").write_text((trained["hf_dir"] / "config.json").read_text())
    cases = {
        "missing.pt": "does not exist",
        "truncated.pt": "corrupt or truncated",
        "zeros.pt": "corrupt or truncated",
        "empty.pt": "empty",
        "other.pt": "not a minisft resume checkpoint",
        "evil.pt": "refused to load",
        "bad.safetensors": "corrupt or truncated safetensors",
    }
    for name, message in cases.items():
        with pytest.raises(ModelLoadError, match=message) as info:
            load_model_for_inference(tmp_path / name)
        assert "\n" not in str(info.value) and name in str(info.value)
    assert not marker.exists()
    with pytest.raises(ModelLoadError, match="refused to load"):
        load_tokenizer_for_model(tmp_path / "evil.pt")
    assert not marker.exists()


# --------------------------------------------------------------------------- chat and eval


def test_chat_prompt_prints_exactly_the_trained_answer(trained):
    system, question, answer = (m["content"] for m in CONVERSATIONS[0])
    result = script("chat.py", "--model_path", str(trained["run_dir"]), "--prompt", question, "--system", system,
                    "--temperature", "0", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout == answer + "\n"


def hand_loss(model, tokenizer) -> tuple[float, int]:
    """Mean CE over assistant tokens, one conversation at a time, without padding (fp32 CE, like the model)."""
    total, count = 0.0, 0
    for messages in CONVERSATIONS:
        ids, mask = encode_conversation(tokenizer, messages, 512)
        with torch.no_grad():
            logits = model(torch.tensor(ids)[None]).logits[0]
        targets = torch.tensor(ids)[1:]
        losses = F.cross_entropy(logits[:-1], targets, reduction="none")
        keep = torch.tensor(mask)[1:]
        total += losses[keep].double().sum().item()
        count += int(keep.sum())
    return total / count, count


def test_eval_reports_exact_match_and_hand_computed_loss(trained, tmp_path):
    out = tmp_path / "result.json"
    result = script("eval_sft.py", "--model_path", str(trained["checkpoint"]), "--data_path", str(trained["data"]),
                    "--batch_size", "2", "--json_out", str(out), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "exact match" in result.stdout
    report = json.loads(out.read_text())
    loss, count = hand_loss(trained["model"], trained["tokenizer"])
    assert report["exact_match"] == 1.0 and report["num_conversations"] == 3
    assert report["num_loss_tokens"] == count
    assert report["loss"] == pytest.approx(loss, rel=1e-5)
    assert report["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)


def test_eval_counts_right_answers_per_task_where_rows_name_one(trained, tmp_path):
    wrong = [*CONVERSATIONS[1][:-1], {"role": "assistant", "content": "6"}]  # the model answers 5
    rows = [(CONVERSATIONS[0], "fact"), (CONVERSATIONS[1], "fact"), (wrong, "fact"), (CONVERSATIONS[2], "chat"),
            (CONVERSATIONS[0], None)]
    data = tmp_path / "tasks.jsonl"
    # the first line with a byte order mark, as some exported files have: read like the others
    data.write_text("\ufeff" + "".join(json.dumps({"conversations": c, **({"task": t} if t else {})}) + "\n"
                                       for c, t in rows), encoding="utf-8")
    out = tmp_path / "result.json"
    result = script("eval_sft.py", "--model_path", str(trained["run_dir"]), "--data_path", str(data),
                    "--json_out", str(out), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert (report["num_correct"], report["num_replies"]) == (4, 5)
    assert report["by_task"] == {"chat": {"right": 1, "total": 1}, "fact": {"right": 2, "total": 3}}
    assert result.stdout.splitlines()[-3:] == ["by task        right/total", "  chat         1/1", "  fact         2/3"]


def test_eval_reads_jsonl_gz_and_parquet_as_training_does(trained, tmp_path):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from scripts.eval_sft import evaluate, read_examples

    rows = [{"conversations": c, "task": t} for c, t in zip(CONVERSATIONS, ("fact", "sum", "fact"))]
    text = "".join(json.dumps(row) + "\n" for row in rows)
    (tmp_path / "e.jsonl").write_text(text, encoding="utf-8")
    (tmp_path / "e.jsonl.gz").write_bytes(gzip.compress(text.encode("utf-8")))
    pq.write_table(pa.Table.from_pylist([{**row, "id": i} for i, row in enumerate(rows)]), tmp_path / "e.parquet")
    model, tokenizer = trained["model"], trained["tokenizer"]
    examples = {name: read_examples(tmp_path / name, tokenizer, 512) for name in ("e.jsonl", "e.jsonl.gz", "e.parquet")}
    assert examples["e.jsonl.gz"] == examples["e.parquet"] == examples["e.jsonl"]
    assert [e.task for e in examples["e.parquet"]] == ["fact", "sum", "fact"]
    results = [evaluate(model, tokenizer, found, 2, 8) for found in examples.values()]
    assert results[0]["exact_match"] == 1.0 and results[0]["by_task"] == {"fact": {"right": 2, "total": 2},
                                                                          "sum": {"right": 1, "total": 1}}
    assert json.dumps(results[1]) == json.dumps(results[2]) == json.dumps(results[0])  # NaN tool-call accuracy
    result = script("eval_sft.py", "--model_path", str(trained["run_dir"]), "--data_path", str(tmp_path / "e.parquet"),
                    "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["by_task"] == results[0]["by_task"]


def test_eval_table_escapes_control_characters_of_task_names():
    from scripts.eval_sft import format_table

    result = {"num_conversations": 1, "num_loss_tokens": 3, "loss": 0.5, "perplexity": 1.6487, "exact_match": 1.0,
              "num_correct": 1, "num_replies": 1, "num_tool_call_turns": 0,
              "by_task": {"x\ry\x1b[2J\x07": {"right": 1, "total": 1}}}
    assert format_table(result).splitlines()[-2:] == ["by task           right/total", "  x\\ry\\x1b[2J\\x07 1/1"]


def test_batched_left_padded_greedy_equals_one_by_one(trained):
    from scripts.eval_sft import greedy_answers, read_examples

    model, tokenizer = trained["model"], trained["tokenizer"]
    examples = read_examples(trained["data"], tokenizer, 512)
    batched = greedy_answers(model, tokenizer, examples, batch_size=3, max_new_tokens=8)
    single = greedy_answers(model, tokenizer, examples, batch_size=1, max_new_tokens=8)
    assert batched == single == [c[-1]["content"] for c in CONVERSATIONS]


def test_bad_input_gives_one_line_error_and_exit_2(trained, tmp_path):
    missing = script("chat.py", "--model_path", str(tmp_path / "nope"), "--prompt", "hi", "--device", "cpu")
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "does not exist" in missing.stderr
    assert missing.stderr.count("\n") == 1
    bad_flag = script("eval_sft.py", "--model_path", str(trained["run_dir"]), "--batch_size", "zero")
    assert bad_flag.returncode == 2 and bad_flag.stderr.startswith("error: ") and bad_flag.stderr.count("\n") == 1
    no_metrics = script("plot_loss.py", "--metrics", str(tmp_path / "run"), "--out", str(tmp_path / "x.png"))
    assert no_metrics.returncode == 2 and no_metrics.stderr == f"error: {tmp_path / 'run'}: metrics file not found\n"


# --------------------------------------------------------------------------- export

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

    again = script("export_hf.py", "--model_path", str(trained["checkpoint"]), "--out_dir", str(out_dir))
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
    again = script("export_hf.py", "--model_path", str(trained["checkpoint"]), "--out_dir", ".", cwd=here)
    assert again.returncode == 2
    assert again.stderr == f"error: --out_dir {here} is not empty (pass --overwrite to replace it)\n"
    (here / "stale.txt").write_text("from before")
    replaced = script("export_hf.py", "--model_path", str(trained["checkpoint"]), "--out_dir", ".", "--overwrite",
                      cwd=here)
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

    def export(out_dir, *extra):
        return script("export_hf.py", "--model_path", str(source), "--out_dir", str(out_dir), "--overwrite", *extra)

    fresh = tmp_path / "fresh"  # a trainer that has just started: nothing but its lock yet
    fresh.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from trainer.checkpoint.save_dir import SaveDirLock; "
         f"locks = [SaveDirLock(path).acquire() for path in {[str(run), str(fresh)]!r}]; print('locked', flush=True); "
         "sys.stdin.read()"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused = export(fresh)
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
    # what an export into the run once left at its top never hides the run's model/
    torch.manual_seed(1)
    MiniMindForCausalLM(model.config).save_pretrained(run)
    for loaded in (load_model_for_inference(run).state_dict(), read_weights(str(run)).state):
        assert torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"],
                           model.state_dict()["model.layers.0.self_attn.q_proj.weight"])


# --------------------------------------------------------------------------- plot


def metric_lines(steps, loss_offset=0.0, kind="train"):
    for step in steps:
        if kind == "train":
            yield {"kind": "train", "step": step, "epoch": 0, "loss": 5.0 - 0.01 * step + loss_offset,
                   "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0 + step, "time": float(step)}
        else:
            yield {"kind": "eval", "step": step, "eval_loss": 4.0 - 0.01 * step + loss_offset}


def test_dedupe_keeps_the_last_line_of_each_step():
    from scripts.plot_loss import dedupe_metrics

    crashed = [*metric_lines(range(1, 16)), *metric_lines([10], kind="eval")]
    resumed = [*metric_lines(range(11, 21), loss_offset=1.0), *metric_lines([10, 20], kind="eval", loss_offset=1.0)]
    curves = dedupe_metrics(crashed + resumed)
    assert [r["step"] for r in curves["train"]] == list(range(1, 21))
    assert [r["step"] for r in curves["eval"]] == [10, 20]
    by_step = {r["step"]: r["loss"] for r in curves["train"]}
    assert by_step[10] == pytest.approx(4.9) and by_step[11] == pytest.approx(5.89)  # resumed values win
    assert curves["eval"][0]["eval_loss"] == pytest.approx(4.9)


def test_plot_draws_the_latest_run_of_a_file_two_runs_wrote_unless_asked(tmp_path, capsys, monkeypatch):
    import scripts.plot_loss as plot_loss

    first = [{**row, "run_id": "a"} for row in metric_lines(range(1, 11))]
    second = [{**row, "run_id": "b"} for row in metric_lines(range(1, 6), loss_offset=2.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first + second))
    drawn = {}
    monkeypatch.setattr(plot_loss, "plot", lambda curves, out, title: drawn.update(curves) or [])
    assert plot_loss.main(["--metrics", str(tmp_path)]) == 0
    assert [(r["step"], r["run_id"]) for r in drawn["train"]] == [(step, "b") for step in range(1, 6)]
    assert capsys.readouterr().out.splitlines()[0] == (
        "note: plotted run b (5 of 15 lines); 1 other run(s) in this file are left out (--runs all plots every line)")
    assert plot_loss.main(["--metrics", str(tmp_path), "--runs", "all"]) == 0
    assert [r["step"] for r in drawn["train"]] == list(range(1, 11))


def test_plot_writes_a_png_and_rejects_empty_metrics(tmp_path, capsys):
    from scripts.plot_loss import main

    lines = [*metric_lines(range(1, 31)), *metric_lines([10, 20, 30], kind="eval"), *metric_lines(range(21, 41))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["--metrics", str(tmp_path), "--out", str(tmp_path / "loss.png")]) == 0
    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit) as done:
        main(["--metrics", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "x.png")])
    assert done.value.code == 2 and "error:" in capsys.readouterr().err


def test_plot_draws_per_source_train_losses_per_file_eval_curves_and_accuracies(tmp_path):
    from scripts.plot_loss import dedupe_metrics, plot

    train = [{**row, "loss/general": 5.0, "loss/tools": 4.0} for row in metric_lines(range(1, 11))]
    evals = [{"kind": "eval", "step": s, "eval_loss": 4.0, "eval_loss/a": 4.1, "eval_loss/b": 3.9,
              "eval_token_accuracy": 0.1 * s, "eval_exact_match/a": 0.0, "eval_loss_tokens": 90,
              "best_metric": "eval_loss", "best_step": 5, "new_best": s == 5} for s in (5, 10)]
    labels = plot(dedupe_metrics(train + evals), tmp_path / "loss.png", "t")
    assert labels == ["train loss", "train loss/general", "train loss/tools", "eval loss", "eval loss/a",
                      "eval loss/b", "eval token accuracy", "eval exact match/a"]
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
