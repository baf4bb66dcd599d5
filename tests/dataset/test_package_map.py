"""A reader finds every module of ``dataset/`` named, with its one-line job, in the docstring of
its package's ``__init__.py`` (``dataset``, ``dataset.cache``, ``dataset.inspection``)."""

import ast
from pathlib import Path

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
