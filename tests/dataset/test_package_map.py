"""A reader finds every module of ``dataset/`` named, with its one-line job, in the docstring of
its package's ``__init__.py`` (``dataset``, ``dataset.cache``, ``dataset.inspection``)."""

import ast
import json
import sys
from pathlib import Path

from dataset import build_cache_and_open, load_tokenizer

DATASET = Path(__file__).resolve().parents[2] / "dataset"


def named_modules(package: Path) -> set[str]:
    """The modules and subpackages a package's docstring names as ``* ``name``  its job`` lines."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    return {line.split("``")[1] for line in doc.splitlines() if line.startswith("* ``") and line.count("``") >= 2}


def test_every_module_and_subpackage_is_named_in_its_package_docstring():
    packages = [DATASET, *(path.parent for path in DATASET.glob("*/__init__.py"))]
    assert {path.name for path in packages} >= {"dataset", "cache", "inspection"}
    for package in packages:
        present = {path.stem for path in package.glob("*.py") if path.name != "__init__.py"}
        present |= {path.parent.name for path in package.glob("*/__init__.py")}
        assert named_modules(package) == present, (package.name, present ^ named_modules(package))


# ----------------------------------------------------------------------------- the walk to token ids

ENTRY = "dataset.sft_dataset"  # build_cache_and_open: build the cache in this process, then open it
SEAM = "dataset.tokens"


def project_walk(frame) -> tuple[str, ...]:
    """The modules of ``dataset/`` whose code is on the stack at ``frame``, outermost first, a
    module's frames in a row counted once."""
    names = []
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("dataset.") and (not names or names[-1] != name):
            names.append(name)
        frame = frame.f_back
    return tuple(reversed(names))


def walks_to_the_encoder(run) -> set[tuple[str, ...]]:
    """Run ``run()``; at each call from the seam into the encoder behind it, the walk that led there."""
    walks = set()

    def profile(frame, event, arg):
        caller = frame.f_back
        if (event == "call" and caller is not None and caller.f_globals.get("__name__") == SEAM
                and frame.f_globals.get("__name__", "").startswith("dataset.")
                and frame.f_globals["__name__"] != SEAM):
            walks.add(project_walk(frame))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return walks


def test_the_walk_from_the_build_entry_to_token_ids_passes_four_modules_and_returns_to_none(tmp_path):
    """``build_cache_and_open`` -> the cache build -> the seam -> the encoder: every call the seam
    makes into its encoder is reached through at most four modules, none of them twice. The walk is
    traced in the process that tokenizes (``num_proc=1``); with more processes the worker pool
    (``cache.workers``, which imports nothing of the project) runs the same chunk function."""
    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": f"What is {i} plus 1?"},
                                                          {"role": "assistant", "content": str(i + 1)}]}) + "\n"
                            for i in range(5)), encoding="utf-8")
    walks = walks_to_the_encoder(lambda: build_cache_and_open(data, None, 64, cache_dir=tmp_path / "cache", num_proc=1))
    assert ("dataset.sft_dataset", "dataset.cache.build", "dataset.tokens", "dataset.chatml_encoder") in walks
    for walk in walks:
        assert walk[0] == ENTRY and len(walk) <= 4 and len(set(walk)) == len(walk), walk


def test_the_worker_pool_runs_the_build_s_chunk_function_and_imports_nothing_of_the_project(monkeypatch):
    """With more processes the walk is the same from the chunk function on: the pool is handed
    ``build.encode_here`` (what ``num_proc=1`` runs here) and knows no module of the project."""
    from dataset.cache import build
    from tests.test_layout import imported_modules, project_modules

    given = []
    monkeypatch.setattr(build, "WorkerPool", lambda function, *args, **kwargs: given.append(function))
    build.start_pool(load_tokenizer(None), 2)
    build.stop_encoding(None)
    assert given == [build.encode_here]
    modules = project_modules()
    assert imported_modules("dataset.cache.workers", modules["dataset.cache.workers"], modules) == set()
