"""The house rules of the package, checked on its source: no module past 450 lines, no private
name imported from another ftrain module (except from ``ftrain.internals``, the plumbing every
module shares), no import cycle among ftrain modules, no module-level mutable registry."""

import ast
import sys
from pathlib import Path

import pytest

import ftrain

ROOT = Path(ftrain.__file__).parent
MODULES = {
    ".".join(("ftrain", *p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): p
    for p in sorted(ROOT.rglob("*.py"))
}
MAX_LINES = 450


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that runs (anywhere in the module), except under
    ``if TYPE_CHECKING:``."""
    found = []

    def visit(node):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _edges() -> dict[str, set[str]]:
    """Module -> the ftrain modules it imports (a name imported from a package counts as the
    submodule of that name when there is one)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _absolute(module, node)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                    for a in node.names
                ]
            graph[module].update(t for t in targets if t in MODULES and t != module)
    return graph


def test_every_module_is_at_most_450_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


INTERNALS = "ftrain.internals"  # plumbing any ftrain module may import, private names too


def _private_imports(modules: dict[str, Path]) -> list[str]:
    """Each import of a private name (``_x``) or through a private module from another ftrain
    module; a name imported from a module of ``ftrain.internals`` may be private."""
    found = []
    for module, path in modules.items():
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, node)
                if not source.startswith("ftrain"):
                    continue
                internal = source == INTERNALS or source.startswith(INTERNALS + ".")
                names = [] if internal else [a.name for a in node.names]
                parts = source.split(".")
            else:
                names, parts = [], [p for a in node.names for p in a.name.split(".")]
            private = [n for n in (*names, *parts) if n.startswith("_") and not n.startswith("__")]
            if private and (isinstance(node, ast.ImportFrom) or parts[0] == "ftrain"):
                found.append(f"{module}: {ast.unparse(node)}")
    return found


def test_no_private_name_is_imported_from_another_ftrain_module():
    found = _private_imports(MODULES)
    assert not found, "private imports across modules:\n" + "\n".join(found)


def test_the_private_import_check_allows_exactly_the_internals(tmp_path):
    """A private name may come from ``ftrain.internals.*`` and from nowhere else; a private
    module is refused under ``ftrain.internals`` too."""
    cases = {
        "from ftrain.internals.scoped import _slot": False,
        "from ftrain.internals import _x": False,
        "from ftrain.internals._hidden import y": True,
        "from ftrain.step.engine import _plan": True,
        "from ftrain.internalsx import _y": True,
        "import ftrain._x": True,
    }
    for i, line in enumerate(cases):
        (tmp_path / f"m{i}.py").write_text(line + "\n")
    fake = {f"ftrain.m{i}": tmp_path / f"m{i}.py" for i in range(len(cases))}
    flagged = {line for line in cases if any(line in f for f in _private_imports(fake))}
    assert flagged == {line for line, bad in cases.items() if bad}


def test_no_import_cycle_among_ftrain_modules():
    graph = _edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_the_cycle_check_can_fail(tmp_path, monkeypatch):
    """The checker above finds a cycle when there is one (two modules importing each other)."""
    (tmp_path / "a.py").write_text("from ftrain.b import x\n")
    (tmp_path / "b.py").write_text("import ftrain.a\nx = 1\n")
    fake = {"ftrain.a": tmp_path / "a.py", "ftrain.b": tmp_path / "b.py"}
    monkeypatch.setattr(sys.modules[__name__], "MODULES", fake)
    graph = _edges()
    assert graph == {"ftrain.a": {"ftrain.b"}, "ftrain.b": {"ftrain.a"}}


def _module_level_mutables(path: Path) -> list[str]:
    """Names bound at module level to an empty list, dict or set display: what a call would fill."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            value = node.value
            empty = (
                isinstance(value, (ast.List, ast.Dict, ast.Set))
                and not getattr(value, "elts", None)
            ) and not getattr(value, "keys", None)
            called = isinstance(value, ast.Call) and ast.unparse(value.func).endswith(
                ("WeakKeyDictionary", "WeakValueDictionary", "defaultdict", "OrderedDict")
            )
            if empty or called:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out.extend(ast.unparse(t) for t in targets)
    return out


def test_no_module_level_mutable_registries():
    """Caches and registries that calls fill live with the object that owns them (a Step's
    ApplyCache) or in a scoped value (ftrain.internals.scoped), never at module level."""
    found = {m: names for m, p in MODULES.items() if (names := _module_level_mutables(p))}
    assert not found, f"module-level mutable containers: {found}"
