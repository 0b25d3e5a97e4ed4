"""Move each test file into the folder that mirrors what it tests, read off the package on disk.

    python tools/mirror_tests.py            # move (git mv), rewrite, print what it did
    python tools/mirror_tests.py --dry-run  # print the plan only

Re-runnable: run it again after modules move between packages and the tests follow them. The
test of ``ftrain/<pkg>/<mod>.py`` becomes ``tests/<pkg>/test_<mod>.py`` (``ftrain/<mod>.py``:
``tests/test_<mod>.py``); the tests of the docs, the notebooks and the README go to
``tests/docs/``, those of ``benchmarks/<name>.py`` or ``tools/<name>.py`` to
``tests/benchmarks/`` or ``tests/tools/``. A test file's name says what it tests: the folders it
sits in and its name after ``test_``, joined by ``_`` (``tests/test_optim_fused.py`` and
``tests/optim/test_fused.py`` both say ``optim_fused``), matched, in this order, to

1. a module whose path, joined by ``_``, is that name (``ftrain/optim/fused.py``);
2. the one module whose path ends with that name (``schedules`` -> ``ftrain/optim/schedules.py``;
   ``loop`` -> ``ftrain/app/loop.py`` once the app has its package);
3. the one module named by the name's last words whose other words each name one of the
   module's packages or no package any more (``distributed_tp_layout`` ->
   ``ftrain/distributed/tensor/tp_layout.py``, or ``ftrain/parallel/tp_layout.py`` once
   ``distributed/`` is gone).

A name that matches no module, or several, stays where it is and is printed with why: a module
that was renamed needs its test renamed by hand (the script never guesses from a name alone, so
``transforms_checkpoint`` does not follow a rename of ``transforms/checkpoint.py`` into
``tests/io/``). After the moves it
rewrites, in the moved files, ``Path(__file__)...parents[N]`` by the change of depth, and in every
tracked text file the paths of the moved tests (``tests/test_optim_fused.py`` ->
``tests/optim/test_fused.py``; a glob such as ``tests/test_optim_*.py`` too, where all it matched
moved to one folder; and the module names, ``from tests.test_optim_fused import ...``), except
in this script and under ``--leave`` folders; and it sets up ``pyproject.toml`` so that the suite runs from
folders: ``pythonpath = ["tests"]`` (the helpers ``tests/_*.py`` import from any folder),
``--import-mode=importlib`` (two ``test_layout.py`` in two folders do not collide, with no
``__init__.py``), and ruff's isort ``known-local-folder`` listing every ``tests/_*.py``.

**Invariant:** the set of test files and their contents are the same before and after, up to the
rewrites above; a file is never moved onto another; a second run right after the first moves
nothing.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

PACKAGE = "ftrain"
DOCS = ("docs", "notebooks", "readme")  # test names that go to tests/docs/ (and their prefixes)
SCRIPTS = ("benchmarks", "tools")  # folders of scripts whose tests mirror them
TEXT = (".py", ".md", ".toml", ".ipynb", ".txt", ".cfg", ".yml", ".yaml", "")


class Move(NamedTuple):
    old: str  # path from the repository root, "/"-separated
    new: str
    rule: str  # which rule placed it


def test_name(path: Path) -> str:
    """What a test file says it tests: ``tests/optim/test_fused.py`` -> ``optim_fused``."""
    folders = path.parent.parts[1:]  # below tests/
    return "_".join([*folders, path.stem.removeprefix("test_")])


def modules(root: Path) -> list[tuple[str, ...]]:
    """The package's modules as path parts below it, without ``.py``: ``("optim", "fused")``;
    a package's ``__init__`` as the package's own parts; ``__main__`` left out."""
    found = []
    for p in sorted((root / PACKAGE).rglob("*.py")):
        parts = p.relative_to(root / PACKAGE).with_suffix("").parts
        if parts[-1] == "__main__" or "__pycache__" in parts:
            continue
        found.append(parts[:-1] if parts[-1] == "__init__" else parts)
    return [m for m in found if m]


def _place(name: str, mods: list[tuple[str, ...]], root: Path):
    """``(folders below tests/, file name after test_, rule)`` for a test name, or why it has no
    place (a string)."""
    words = name.split("_")
    if words[0] in DOCS:
        rest = "_".join(words[1:]) if words[0] == "docs" else name
        return ("docs",), rest or name, "docs/"
    if words[0] in SCRIPTS and len(words) > 1 and (root / words[0]).is_dir():
        return (words[0],), "_".join(words[1:]), f"{words[0]}/"
    flat = {"_".join(m): m for m in mods}
    packages = {p for m in mods for p in m[:-1]}
    if name in flat:
        return flat[name][:-1], flat[name][-1], "1: its path"
    ends = [m for f, m in flat.items() if f.endswith("_" + name)]
    if len(ends) == 1:
        return ends[0][:-1], ends[0][-1], "2: the end of its path"
    if len(ends) > 1:
        return f"{name!r} ends {len(ends)} module paths: " + ", ".join("/".join(m) for m in ends)
    for k in range(1, len(words)):
        prefix, stem = words[:k], "_".join(words[k:])
        named = [m for m in mods if m[-1] == stem]
        # each other word is one of the module's packages, or a package that is gone
        inside = [m for m in named if all(w in m[:-1] or w not in packages for w in prefix)]
        if len(inside) == 1:
            return inside[0][:-1], stem, "3: its last words, in its packages"
        if named:
            found = ", ".join("/".join(m) for m in named)
            return f"{stem!r} names {found}; not one of them is in {'/'.join(prefix)}"
    return (
        f"no module of {PACKAGE}/ is named by {name!r}: it stays (a test of a renamed module needs"
        " its new name by hand; a test of the whole suite or package belongs where it is)"
    )


def plan(root: Path) -> tuple[list[Move], list[tuple[str, str]]]:
    """The moves that mirror the package, and the test files left where they are with why."""
    mods = modules(root)
    tests = sorted(p.relative_to(root) for p in (root / "tests").rglob("test_*.py"))
    wanted, unplaced = [], []
    for rel in tests:
        placed = _place(test_name(rel), mods, root)
        if isinstance(placed, str):
            unplaced.append((rel.as_posix(), placed))
            continue
        folders, stem, rule = placed
        new = Path("tests", *folders, f"test_{stem}.py")
        if new != rel:
            wanted.append(Move(rel.as_posix(), new.as_posix(), rule))
    leaving = {m.old for m in wanted}
    staying = {t.as_posix() for t in tests} - leaving
    targets = [m.new for m in wanted]
    moves = []
    for m in wanted:
        if m.new in staying or targets.count(m.new) > 1:
            others = [o.old for o in wanted if o.new == m.new and o is not m]
            unplaced.append((m.old, f"{m.new} is taken ({', '.join(others) or 'it exists'})"))
        else:
            moves.append(m)
    return moves, unplaced


_PARENTS = re.compile(r"(Path\(__file__\)(?:\.resolve\(\))?\.parents\[)(\d+)(\])")


def rewrite_depth(text: str, delta: int) -> str:
    """``Path(__file__).parents[N]`` -> ``parents[N + delta]``: the same folder from a new depth."""
    return _PARENTS.sub(lambda m: f"{m[1]}{int(m[2]) + delta}{m[3]}", text)


def configure(pyproject: Path, helpers: list[str]) -> str:
    """``pyproject.toml``'s text with ``pythonpath = ["tests"]``, ``--import-mode=importlib`` in
    pytest's ``addopts`` and isort's ``known-local-folder`` naming ``helpers``."""
    text = pyproject.read_text()
    section = "[tool.pytest.ini_options]\n"
    if section not in text:
        text = text.rstrip("\n") + "\n\n" + section
    if not re.search(r"(?m)^pythonpath\s*=", text):
        text = text.replace(section, section + 'pythonpath = ["tests"]\n')
    addopts = re.search(r'(?m)^addopts\s*=\s*"([^"]*)"', text)
    if addopts is None:
        text = text.replace(section, section + 'addopts = "--import-mode=importlib"\n')
    elif "--import-mode" not in addopts[1]:
        opts = " ".join(filter(None, [addopts[1], "--import-mode=importlib"]))
        text = text[: addopts.start()] + f'addopts = "{opts}"' + text[addopts.end() :]
    local = re.search(r"(?m)^known-local-folder\s*=\s*\[([^\]]*)\]", text)
    listed = ", ".join(f'"{h}"' for h in helpers)
    if local is not None:
        text = text[: local.start()] + f"known-local-folder = [{listed}]" + text[local.end() :]
    else:
        text = text.rstrip("\n") + f"\n\n[tool.ruff.lint.isort]\nknown-local-folder = [{listed}]\n"
    return text


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, check=True, capture_output=True, text=True
    ).stdout


def rename_globs(texts: list[str], renamed: dict[str, str], after: set[str]) -> dict[str, str]:
    """Old glob -> new glob for each ``tests/...*...py`` glob in ``texts`` whose files all moved
    to one folder where they are all that the new glob ``tests/<folder>/test_*.py`` matches."""
    found = {g for t in texts for g in _TEST_PATH.findall(t) if "*" in g}
    globs = {}
    for old in found:
        matched = [o for o in renamed if fnmatch.fnmatch(o, old)]
        folders = {str(Path(renamed[o]).parent) for o in matched}
        if len(folders) != 1:
            continue
        new = f"{folders.pop()}/test_*.py"
        if {renamed[o] for o in matched} == {a for a in after if fnmatch.fnmatch(a, new)}:
            globs[old] = new
    return globs


def _dotted(path: str) -> str:
    """A test file's module name from the repository root: ``tests/optim/test_fused.py`` ->
    ``tests.optim.test_fused`` (what a test imports to reach another's helpers)."""
    return path.removesuffix(".py").replace("/", ".")


def apply(root: Path, moves: list[Move], leave: tuple[str, ...] = ()) -> list[str]:
    """Carry out ``moves`` with ``git mv`` and the rewrites; the files changed besides them."""
    before = set(_git(root, "ls-files", "tests").splitlines())
    for m in moves:
        (root / m.new).parent.mkdir(parents=True, exist_ok=True)
        _git(root, "mv", m.old, m.new)
        delta = len(Path(m.new).parts) - len(Path(m.old).parts)
        path = root / m.new
        text = path.read_text()
        if delta and (new := rewrite_depth(text, delta)) != text:
            path.write_text(new)
    renamed = {m.old: m.new for m in moves}
    after = (before - set(renamed)) | set(renamed.values())
    this = Path(__file__).resolve()
    texts = {}
    for rel in _git(root, "ls-files").splitlines():
        path = root / rel
        if not path.is_file() or path.suffix not in TEXT or path.resolve() == this:
            continue
        if any(rel == d or rel.startswith(d.rstrip("/") + "/") for d in leave):
            continue
        try:
            texts[rel] = path.read_text()
        except UnicodeDecodeError:
            continue
    renamed.update(rename_globs(list(texts.values()), renamed, after))
    renamed.update({_dotted(o): _dotted(n) for o, n in list(renamed.items()) if "*" not in o})
    changed = []
    if renamed:
        keys = sorted(renamed, key=len, reverse=True)
        pattern = re.compile(r"\b(?:" + "|".join(re.escape(k) for k in keys) + r")(?![\w*])")
        for rel, text in texts.items():
            new = pattern.sub(lambda m: renamed[m[0]], text)
            if new != text:
                (root / rel).write_text(new)
                changed.append(rel)
    pyproject = root / "pyproject.toml"
    helpers = sorted(p.stem for p in (root / "tests").glob("_*.py"))
    if (new := configure(pyproject, helpers)) != pyproject.read_text():
        pyproject.write_text(new)
        changed.append("pyproject.toml")
    return changed


_TEST_PATH = re.compile(r"\btests/(?:[\w]+/)*test_[\w*]*\.py\b")


def stale_references(root: Path) -> list[tuple[str, str]]:
    """``(file, path)`` for each test path (or glob such as ``tests/test_transforms_*.py``) that a
    tracked text file names and that matches no file: what the rewrite could not follow."""
    stale = []
    this = Path(__file__).resolve()
    for rel in _git(root, "ls-files").splitlines():
        path = root / rel
        if not path.is_file() or path.suffix not in TEXT or path.resolve() == this:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for ref in sorted(set(_TEST_PATH.findall(text))):
            if not any(root.glob(ref)):
                stale.append((rel, ref))
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--dry-run", action="store_true", help="print the plan, move nothing")
    parser.add_argument(
        "--leave",
        action="append",
        default=[],
        metavar="DIR",
        help="do not rewrite test paths in files under DIR (repeatable), e.g. --leave ftrain",
    )
    args = parser.parse_args(argv)
    moves, unplaced = plan(args.root)
    for m in moves:
        print(f"{m.old} -> {m.new}  ({m.rule})")
    if not args.dry_run and moves:
        for rel in apply(args.root, moves, tuple(args.leave)):
            print(f"rewritten: {rel}")
    elif not args.dry_run:
        pyproject = args.root / "pyproject.toml"
        helpers = sorted(p.stem for p in (args.root / "tests").glob("_*.py"))
        if (new := configure(pyproject, helpers)) != pyproject.read_text():
            pyproject.write_text(new)
            print("rewritten: pyproject.toml")
    print(f"{len(moves)} moved, {len(unplaced)} not placed" + (":" if unplaced else ""))
    for rel, why in unplaced:
        print(f"  {rel}: {why}")
    if not args.dry_run:
        for rel, ref in stale_references(args.root):
            print(f"names no test file: {rel}: {ref}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
