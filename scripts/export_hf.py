"""Export a trained model as a self-contained Hugging Face directory.

    python scripts/export_hf.py --model_path out/checkpoints/step_00000100.pt --out_dir export [--dtype bfloat16]

The directory holds config.json (with ``auto_map``), model.safetensors, the model code
(configuration_minimind.py, modeling_minimind.py, packed_attention.py) and the tokenizer files with the chat
template, so a plain transformers install loads it without this repo:

    AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)
    AutoTokenizer.from_pretrained(out_dir)

A non-empty ``--out_dir`` is only replaced with ``--overwrite``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._common import (  # noqa: E402
    DTYPES, ArgumentParser, add_model_args, fail, load_model_and_tokenizer, resolve_dtype, run_main,
)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[0], prog="export_hf.py")
    add_model_args(parser)
    parser.set_defaults(device="cpu")
    parser.add_argument("--out_dir", required=True, help="directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out_dir")
    # --dtype (from add_model_args) is the dtype of the exported weights.
    return parser


def check_out_dir(out_dir: Path, model_path: Path, overwrite: bool) -> None:
    """Refuse to clobber existing files (without --overwrite) or the model being exported."""
    if out_dir.exists() and not out_dir.is_dir():
        fail(f"--out_dir {out_dir} exists and is not a directory")
    source = model_path.resolve()
    target = out_dir.resolve()
    if target == source or target in source.parents:
        fail(f"--out_dir {out_dir} contains the model being exported ({model_path}); choose another directory")
    from trainer.checkpoint import inside_a_run_model_dir

    run_model = inside_a_run_model_dir(str(target))
    if run_model:
        fail(f"--out_dir {out_dir} is inside the training run's {run_model}, which the run's next save replaces; "
             "choose a directory outside it")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        fail(f"--out_dir {out_dir} is not empty (pass --overwrite to replace it)")


def export(model, tokenizer, out_dir: Path) -> None:
    """Write model + tokenizer into a fresh sibling folder, then move it to ``out_dir``."""
    from transformers.utils import logging as hf_logging

    staging = out_dir.with_name(f".{out_dir.name}.export-tmp")
    shutil.rmtree(staging, ignore_errors=True)
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out_dir = Path(args.out_dir)
    check_out_dir(out_dir, Path(args.model_path), args.overwrite)
    model, tokenizer = load_model_and_tokenizer(args)
    model.config.dtype = resolve_dtype(args.dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    export(model, tokenizer, out_dir)
    files = ", ".join(sorted(p.name for p in out_dir.iterdir()))
    print(f"exported {DTYPES[args.dtype]} model to {out_dir}: {files}")
    return 0


if __name__ == "__main__":
    run_main(main)
