"""No module of the project uses another project module's private (``_underscore``) names: not by
importing them, not as an attribute of a module it imported. A name a module shares is public and
documented as such. (A private module, ``scripts/_common.py``, shares public names; other
libraries' private names, ``os._exit``, are not the project's to rule.)"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "dataset", "model", "scripts")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(module: str) -> bool:
    return module.partition(".")[0] in PACKAGES


def private_uses(path: Path) -> list[str]:
    """``line: name`` of every private name of another project module that ``path`` imports or reads."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules: set[str] = set()  # local names bound by imports from the project
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    modules.add(alias.asname or alias.name.partition(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.level or _ours(node.module or "")):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {'.' * node.level}{node.module or ''} import {alias.name}")
                modules.add(alias.asname or alias.name)  # a module or not: only private attributes are looked at
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                and _private(node.attr):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    files = [REPO / "train_full_sft.py", *(path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py")))]
    bad = {str(path.relative_to(REPO)): uses for path in files if (uses := private_uses(path))}
    assert not bad, bad


def test_the_check_sees_an_imported_private_name_and_a_private_attribute(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os, dataset.cache.build as b\nfrom .x import _hidden, shown\nfrom trainer import _y\n"
                    "b._secret()\nb.__name__\nos._exit(0)\n", encoding="utf-8")
    assert private_uses(path) == ["2: from .x import _hidden", "3: from trainer import _y", "4: b._secret"]
