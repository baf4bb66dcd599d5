"""Export a trained model: a standard Qwen3 directory, a MiniMind .pth, or the remote-code directory.

    python scripts/export_hf.py --model_path out --out_dir export                  # --format qwen3
    python scripts/export_hf.py --model_path out --out_dir ../minimind/out --format minimind

--format qwen3 (default): config.json with model_type qwen3 (qwen3_moe for an MoE model),
model.safetensors and the tokenizer with its chat template. Any transformers install (and every
tool that knows Qwen3: vLLM, llama.cpp's converter, ...) loads it without remote code:

    AutoModelForCausalLM.from_pretrained(out_dir); AutoTokenizer.from_pretrained(out_dir)

--format minimind: ``{--save_weight}_{hidden}[_moe].pth`` in ``--out_dir``, MiniMind's own
naming and dtype (float16, lm_head.weight included), which MiniMind's ``eval_llm.py`` loads with
``strict=True``; the MiniMindConfig arguments it needs beyond the defaults are printed.

--format remote-code: model_type minimind with ``auto_map`` and the model code
(configuration_minimind.py, modeling_minimind.py, packed_attention.py): needs
``trust_remote_code=True``.

A config a format cannot express is refused with the reason. A non-empty ``--out_dir`` (for
minimind: an existing .pth) is only replaced with ``--overwrite``. A training run's directory
(checkpoints/, metrics.jsonl or a held .lock) and everything inside it are never written.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._common import (  # noqa: E402
    DTYPES, ArgumentParser, add_model_args, fail, load_model_and_tokenizer, resolve_dtype, run_main,
)
from trainer.args import path_value  # noqa: E402


FORMATS = ("qwen3", "minimind", "remote-code", "gguf")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[0], prog="export_hf.py")
    add_model_args(parser)
    parser.set_defaults(device="cpu")
    parser.add_argument("--out_dir", required=True, type=path_value, help="directory to write")
    parser.add_argument("--format", choices=FORMATS, default="qwen3",
                        help="qwen3: standard Qwen3/Qwen3-MoE dir (no remote code); minimind: MiniMind .pth; "
                             "remote-code: model_type minimind with the model code; gguf: llama.cpp / Ollama file")
    parser.add_argument("--save_weight", default="full_sft",
                        help="--format minimind: file name prefix, as MiniMind's --save_weight")
    parser.add_argument("--gguf_type", choices=("f32", "f16", "bf16", "q8_0"), default="f16",
                        help="--format gguf: tensor type of {out_dir}/model-{type}.gguf (docs/weights.md, GGUF)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out_dir (or an existing .pth)")
    # --dtype (from add_model_args) is the dtype of the exported weights, except where FIXED_DTYPE says.
    return parser


# The formats whose weights' dtype --dtype does not set, and what sets it.
FIXED_DTYPE = {"minimind": "its .pth is always float16, as MiniMind's own",
               "gguf": "--gguf_type sets the tensor type"}


def refuse_run_dirs(out_dir: Path, overwrite: bool) -> None:
    """A training run's folder (its --save_dir, or anything inside it) is never written, and with
    --overwrite not one that holds a run either: the run's checkpoints, metrics and lock would go."""
    from trainer.checkpoint.save_dir import inside_a_run_model_dir, lock_holder, run_dir_at_or_above, run_dir_below

    run_model = inside_a_run_model_dir(str(out_dir))
    if run_model:
        fail(f"--out_dir {out_dir} is inside the training run's {run_model}, which the run's next save replaces; "
             "choose a directory outside it")
    run = run_dir_at_or_above(str(out_dir)) or run_dir_at_or_above(str(out_dir.resolve()))  # also through a link
    if run:
        where = "is" if Path(run) in (out_dir, out_dir.resolve()) else "is inside"
        holder = lock_holder(run)
        if holder:
            fail(f"--out_dir {out_dir} {where} {run}, the --save_dir of a training run in progress (pid {holder}); "
                 "export to a directory outside it")
        fail(f"--out_dir {out_dir} {where} the training run directory {run} (it has checkpoints/ or "
             "metrics.jsonl), whose files an export must not replace; choose a directory outside it")
    if overwrite and out_dir.is_dir():
        inner = run_dir_below(str(out_dir))
        if inner:
            fail(f"--out_dir {out_dir} holds the training run directory {inner}, which --overwrite would delete; "
                 "choose another directory")


def check_out_dir(out_dir: Path, model_path: Path, overwrite: bool) -> None:
    """Refuse to clobber existing files (without --overwrite), the model being exported, or a run's folders."""
    if out_dir.exists() and not out_dir.is_dir():
        fail(f"--out_dir {out_dir} exists and is not a directory")
    source = model_path.resolve()
    target = out_dir.resolve()
    if target == source or target in source.parents:
        fail(f"--out_dir {out_dir} contains the model being exported ({model_path}); choose another directory")
    refuse_run_dirs(out_dir, overwrite)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        fail(f"--out_dir {out_dir} is not empty (pass --overwrite to replace it)")


def export_dir(out_dir: Path, overwrite: bool, write):
    """Run ``write(folder)`` on a fresh sibling folder (it writes a directory format's files, or the GGUF
    file), then put those files in ``out_dir`` in place of what it held; returns what ``write`` returned.

    ``out_dir`` itself is kept when it exists (it may be the current directory, ``--out_dir .``):
    its old entries are moved to a second sibling, the new ones moved in, the old ones deleted. A
    second sibling left by an export stopped during that swap holds files that are nowhere else: it
    is refused, not deleted. An ``out_dir`` that is a mount point (a container's volume) is a
    filesystem of its own, into which nothing can be renamed from its parent: the two folders are
    then inside it."""
    from trainer.checkpoint.files import write_failure

    if out_dir.is_dir() and os.path.ismount(out_dir):
        staging, old = out_dir / ".export-tmp", out_dir / ".export-old"
    else:
        staging = out_dir.with_name(f".{out_dir.name}.export-tmp")
        old = out_dir.with_name(f".{out_dir.name}.export-old")
    if old.is_dir() and any(old.iterdir()):
        fail(f"an export to {out_dir} was stopped while it swapped the files there, and the old files "
             f"are in {old}: move back what you want to keep, delete {old}, and export again")
    for leftover in (staging, old):  # of an export that was killed
        shutil.rmtree(leftover, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.mkdir()
        written = write(str(staging))
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        reason = write_failure(error)  # a full disk: OSError, SafetensorError or tokenizers' bare Exception
        if reason is None:
            raise
        fail(f"could not write the export to {out_dir}: {reason} (nothing was changed there)")
    try:
        refuse_run_dirs(out_dir, overwrite)  # again: a trainer may have started there since the first check
    except SystemExit:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not out_dir.exists():
        staging.rename(out_dir)
        return written
    old.mkdir()
    for entry in out_dir.iterdir():
        if entry not in (staging, old):
            entry.rename(old / entry.name)
    for entry in staging.iterdir():
        entry.rename(out_dir / entry.name)
    staging.rmdir()
    shutil.rmtree(old)
    return written


def export_minimind(model, out_dir: Path, prefix: str, overwrite: bool) -> Path:
    from trainer.errors import CheckpointError
    from trainer.weights.read import minimind_pth_name
    from trainer.weights.write import minimind_settings, write_minimind_pth

    target = out_dir / minimind_pth_name(prefix, model.config.hidden_size, model.config.use_moe)
    if target.exists() and not overwrite:
        fail(f"{target} exists (pass --overwrite to replace it)")
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        write_minimind_pth(model, str(target))
    except CheckpointError as error:  # a full disk (the .pth is written atomically: nothing is left)
        fail(str(error))
    settings = minimind_settings(model.config)
    config = model.config
    print(f"MiniMind loads it with MiniMindConfig(hidden_size={config.hidden_size}, num_hidden_layers="
          f"{config.num_hidden_layers}, use_moe={config.use_moe}"
          + "".join(f", {k}={v!r}" for k, v in settings.items()) + ")")
    return target


def main(argv: list[str] | None = None) -> int:
    from trainer.args import explicit_flags
    from trainer.weights.write import minimind_unsupported, pth_prefix_problem, qwen3_unsupported, write_model_dir

    parser = build_parser()
    args = parser.parse_args(argv)
    given = explicit_flags(parser, argv)
    for flag, owner in (("save_weight", "minimind"), ("gguf_type", "gguf")):  # else ignored without a word
        if flag in given and args.format != owner:
            fail(f"--{flag} is a flag of --format {owner}, not of --format {args.format}")
    if "dtype" in given and args.format in FIXED_DTYPE:
        fail(f"--dtype does not apply to --format {args.format}: {FIXED_DTYPE[args.format]}")
    out_dir = Path(os.path.abspath(args.out_dir))  # "." and "dir/.." have no name of their own
    if not out_dir.name:
        fail(f"--out_dir {args.out_dir} is the file system's root: choose a folder")
    if args.format == "minimind":
        problem = pth_prefix_problem(args.save_weight, "--out_dir")
        if problem:
            fail(problem)
        if out_dir.exists() and not out_dir.is_dir():
            fail(f"--out_dir {out_dir} exists and is not a directory")
        refuse_run_dirs(out_dir, overwrite=False)  # only the .pth is replaced, never the folder
    else:
        check_out_dir(out_dir, Path(args.model_path), args.overwrite)
    model, tokenizer = load_model_and_tokenizer(args)
    unsupported = {"qwen3": qwen3_unsupported, "minimind": minimind_unsupported}.get(args.format, lambda c: None)
    reason = unsupported(model.config)
    if reason:
        fail(f"--format {args.format} cannot express this model: {reason} (use --format remote-code)")
    if args.format == "gguf":  # llama.cpp / Ollama: trainer/weights/gguf.py
        from trainer.weights.gguf import export_gguf

        print("\n".join(export_dir(out_dir, args.overwrite,
                                   lambda folder: export_gguf(model, tokenizer, folder, args.gguf_type, out_dir))))
        return 0
    if args.format == "minimind":
        target = export_minimind(model, out_dir, args.save_weight, args.overwrite)
        print(f"exported float16 MiniMind weights to {target}")
        return 0
    dtype = resolve_dtype(args.dtype)
    model.config.dtype = dtype
    export_dir(out_dir, args.overwrite, lambda folder: write_model_dir(model, tokenizer, folder, dtype, args.format))
    files = ", ".join(sorted(p.name for p in out_dir.iterdir()))
    print(f"exported {DTYPES[args.dtype]} {args.format} model to {out_dir}: {files}")
    return 0


if __name__ == "__main__":
    run_main(main)
