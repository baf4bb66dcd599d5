"""The shape of the code: no import cycle among the project's modules (imports inside functions
count too), and no module over 450 lines: the packages, scripts/, train_full_sft.py and tests/."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "dataset", "model", "scripts")
MAX_LINES = 450


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    files = [REPO / "train_full_sft.py", *(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))]
    return {module_name(path): path for path in files}


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file, with the packages they live in."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        ancestors = {".".join(name.split(".")[:end]) for end in range(1, name.count(".") + 1)}
        for target in targets:
            parts = target.split(".")
            for end in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ first,
                prefix = ".".join(parts[:end])  # except the packages the importer itself lives in (already running)
                if prefix in modules and prefix != name and (prefix == target or prefix not in ancestors):
                    found.add(prefix)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycle_among_the_projects_modules():
    modules = project_modules()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert graph["trainer.loop.loop"] >= {"trainer.loop.state", "trainer.checkpoint.save_dir"}  # the walk sees imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle_through_an_import_inside_a_function(tmp_path):
    (tmp_path / "a.py").write_text("import b\n", encoding="utf-8")
    (tmp_path / "b.py").write_text("def late():\n    from a import x\n", encoding="utf-8")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert find_cycle(graph) == ["a", "b", "a"]


def over_the_limit(paths) -> dict[str, int]:
    """The line count of each of ``paths`` that has more than MAX_LINES lines, by its path in the repository."""
    return {str(path.relative_to(REPO)): lines for path in paths
            if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}


def test_no_module_of_the_packages_scripts_or_the_training_script_is_over_450_lines():
    modules = project_modules()
    assert {"train_full_sft", "scripts.bench", "trainer.args"} <= set(modules)  # every kind is measured
    long = over_the_limit(modules.values())
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_module_of_the_tests_is_over_450_lines():
    tests = sorted((REPO / "tests").rglob("*.py"))
    assert {"tests/conftest.py", "tests/helpers/trainer_launch.py", "tests/trainer/checkpoint/test_resume.py"} <= {
        str(path.relative_to(REPO)) for path in tests}  # the test folders and their helpers are measured
    long = over_the_limit(tests)
    assert not long, f"test modules over {MAX_LINES} lines: {long}"
