"""Which tests are slow, read off their source: ``conftest.py`` marks them ``slow`` at collection.

A test is slow when it, a fixture it uses, or a helper of the suite that either of them calls
(followed through the tests' own modules, to any depth) names one of :data:`SLOW_NAMES`: it
starts processes (``run_distributed``, torchrun, multiprocessing), runs a subprocess (the
``ftrain`` command in a child, a benchmark script), executes a notebook or a guide's code blocks
(``exec``), compiles (``ft.compile``, ``torch.compile``, the ``assert_no_recompile`` /
``assert_one_graph`` checks, ``dynamo.explain``), or measures a step's peak memory by running it
(``peak_bytes``, ``ft.fit``); or when it uses a fixture of :data:`SLOW_FIXTURES` (a training run of
the ``ftrain`` command). Tests slow for another reason (a long trajectory) are marked by hand,
with the reason.

Why the source and not a list of files or of measured times: a new test that spawns or compiles is
marked the day it is written, wherever it sits and whichever helper it reaches the spawn through
(the 2-rank fixtures are followed to their ``run_distributed``), and a fast test beside it in the
same file stays in the fast tier. Measured times depend on the machine and its load; a per-file
rule goes stale as soon as a file gains one test of the other kind.

**Invariant:** :func:`slow_reason` is a pure function of the source files of the suite; it names
the first slow name found (for ``pytest --markers``-style reports), or ``None``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# A dotted name as written in the source (``ft.compile``), or its last part alone where that part
# means one thing (``run_distributed``, ``subprocess``), -> why it is slow.
SLOW_NAMES = {
    # processes
    "run_distributed": "starts processes",
    "torchrun": "starts processes",
    "multiprocessing": "starts processes",
    "start_processes": "starts processes",
    # subprocesses
    "subprocess": "runs a subprocess",
    "Popen": "runs a subprocess",
    # notebooks
    "nbclient": "runs a notebook",
    "NotebookClient": "runs a notebook",
    # compiling
    "ft.compile": "compiles",
    "ftrain.compile": "compiles",
    "torch.compile": "compiles",
    "ft_compile": "compiles",
    "assert_no_recompile": "compiles",
    "assert_one_graph": "compiles",
    "dynamo.explain": "compiles",
    "torch._dynamo.explain": "compiles",
    # running a guide's code blocks (docs/*.md, the README), as a notebook would
    "exec": "runs a guide's code",
    # measuring memory: the real step run under an allocation tracker, once per candidate
    "peak_bytes": "measures a step's peak memory",
    "ft.fit": "measures a step's peak memory",
}

# A fixture by name -> why a test that uses it is slow.
SLOW_FIXTURES = {
    "tiny_run": "trains through the ftrain command",  # the flags of a tiny `ftrain train` run
}


@functools.cache
def _top_level(path: str) -> dict[str, list[ast.AST]]:
    """Top-level name -> the statements of ``path`` that define it (functions, classes,
    assignments), each class's methods under ``Class.method`` too."""
    tree = ast.parse(Path(path).read_text(), filename=path)
    found: dict[str, list[ast.AST]] = {}
    for node in tree.body:
        names: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found.setdefault(f"{node.name}.{sub.name}", []).append(sub)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        for name in names:
            found.setdefault(name, []).append(node)
    return found


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain on a name, else ``None``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _names(node: ast.AST) -> set[str]:
    """Every name and dotted name the code of ``node`` reads or imports."""
    names: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, ast.Attribute) and (dotted := _dotted(sub)):
            names.add(dotted)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            names.update(a.asname or a.name for a in sub.names)
            names.update(a.name for a in sub.names)
            if isinstance(sub, ast.ImportFrom) and sub.module:
                names.add(sub.module)
    return names


def _in_tests(path: str | None, root: Path) -> bool:
    return path is not None and Path(path).resolve().is_relative_to(root)


def _reason_of(names: set[str]) -> str | None:
    """Why a piece of code naming ``names`` is slow: a dotted name of :data:`SLOW_NAMES`, or a
    part of a dotted name that is an undotted one (``subprocess.run``, ``testing.run_distributed``)."""
    for name in sorted(names):
        for key in (name, *name.split(".")):
            if key in SLOW_NAMES:
                return f"{SLOW_NAMES[key]}: {name}"
    return None


def _where(obj, root: Path) -> tuple[str, str, dict] | None:
    """``(source file, qualified name, globals)`` of a function or class defined in tests/."""
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return None
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        return None
    if not _in_tests(path, root):
        return None
    scope = obj.__globals__ if inspect.isfunction(obj) else vars(sys.modules[obj.__module__])
    return path, obj.__qualname__, scope


def slow_reason(fn, fixtures=(), fixture_names=(), root: Path = TESTS) -> str | None:
    """Why the test function ``fn`` (using the fixture functions ``fixtures``, named
    ``fixture_names``) is slow, or ``None``: a fixture of :data:`SLOW_FIXTURES`, or the first name
    of :data:`SLOW_NAMES` in the code it reaches within ``root`` (tests/: its decorators, the
    helpers, tables and fixtures it names, and theirs)."""
    for name in fixture_names:
        if name in SLOW_FIXTURES:
            return f"{SLOW_FIXTURES[name]}: {name}"
    todo = [w for f in (fn, *fixtures) if (w := _where(f, root))]
    seen: set[tuple[str, str]] = set()
    while todo:
        path, qualname, scope = todo.pop()
        if (path, qualname) in seen:
            continue
        seen.add((path, qualname))
        for node in _top_level(path).get(qualname, []):
            names = _names(node)
            if reason := _reason_of(names):
                return reason
            for head in {n.split(".")[0] for n in names}:
                if head in _top_level(path):
                    todo.append((path, head, scope))
                elif where := _where(scope.get(head), root):
                    todo.append(where)
    return None
