"""A tiny model overfitted on three conversations, saved in every form a model path can take, and a way to run
the user scripts (scripts/chat.py, eval_sft.py, export_hf.py, plot_loss.py) on it."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from dataset import SFTCollator, encode_conversation, load_tokenizer
from model import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.in_process import run_in_process

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
    """`python scripts/<name> ARGS` run in `cwd`; the finished process."""
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def script_in_process(name: str, *args: str, cwd=REPO) -> subprocess.CompletedProcess:
    """`scripts/<name> ARGS` run as its `__main__` runs it (`run_main(main)`), in this process and in `cwd`:
    the exit status, stdout and stderr that `script` gives (tests/helpers/in_process.py)."""
    from scripts._common import run_main

    main = importlib.import_module(f"scripts.{name.removesuffix('.py')}").main
    return run_in_process([name, *args], lambda: run_main(lambda: main(list(args))), cwd=cwd)


def greedy(model, tokenizer, messages) -> str:
    """The model's greedy reply to `messages` (at most 16 tokens)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def overfitted_model(tmp_path_factory) -> dict:
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
