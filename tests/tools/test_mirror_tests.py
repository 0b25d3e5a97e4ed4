"""tools/mirror_tests.py on a small repository made here: each test file goes to the folder that
mirrors its module, what has no single module stays and is named, a second run moves nothing, and a
run after modules move between packages makes the tests follow."""

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
spec = importlib.util.spec_from_file_location("mirror_tests", ROOT / "tools" / "mirror_tests.py")
mirror = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mirror)

# Names that no real file has, so that a real run of the script never rewrites the paths here.
MODULES = ["__init__", "trainer", "scopes", "optim/__init__", "optim/adam", "optim/warmup",
           "io/layout", "memory/layout", "models/net", "recipes/net", "distributed/tp_mesh"]  # fmt: skip
TESTS = ["optim_adam", "warmup", "io_layout", "memory_layout", "trainer", "docs_intro", "readme",
         "net", "gadget", "distributed_tp_mesh", "benchmarks_speed"]  # fmt: skip


def short(path: str) -> str:
    return path.removeprefix("tests/")


def doc_line(depth: int) -> str:
    """A test's line that finds the repository from its file (written with a variable, so that a
    real run of the script does not rewrite this file's own text)."""
    return f'DOC = Path(__file__).resolve().parents[{depth}] / "docs"\n'


def import_line(module: str) -> str:
    """A test's line that imports from itself by its module name (what a function sent to other
    processes does), written with a variable for the same reason."""
    return f"from tests.{module} import SIZES\n"


def make_repo(root: Path) -> Path:
    for m in MODULES:
        (root / "ftrain" / f"{m}.py").parent.mkdir(parents=True, exist_ok=True)
        (root / "ftrain" / f"{m}.py").write_text("")
    (root / "tests").mkdir()
    for t in TESTS:
        (root / "tests" / f"test_{t}.py").write_text(doc_line(1))
    (root / "tests" / "test_io_layout.py").write_text(import_line("test_io_layout"))
    (root / "tests" / "_tiny.py").write_text("")
    (root / "benchmarks").mkdir()
    (root / "docs").mkdir()
    (root / "docs" / "intro.md").write_text("checked by `tests/test_docs_intro.py`\n")
    io = "io"  # a variable, so that a real run does not rewrite the glob here
    (root / "docs" / "io.md").write_text(f"tests/test_{io}_*.py, tests/test_*.py\n")
    (root / "pyproject.toml").write_text(
        '[tool.ruff.lint.isort]\nknown-local-folder = ["_old"]\n\n'
        '[tool.pytest.ini_options]\ntestpaths = ["tests"]\naddopts = ""\n'
    )
    return root


def test_the_plan_mirrors_the_package_and_names_what_it_cannot_place(tmp_path):
    moves, unplaced = mirror.plan(make_repo(tmp_path))
    assert {short(m.old): short(m.new) for m in moves} == {
        "test_optim_adam.py": "optim/test_adam.py",
        "test_warmup.py": "optim/test_warmup.py",
        "test_io_layout.py": "io/test_layout.py",
        "test_memory_layout.py": "memory/test_layout.py",
        "test_docs_intro.py": "docs/test_intro.py",
        "test_readme.py": "docs/test_readme.py",
        "test_distributed_tp_mesh.py": "distributed/test_tp_mesh.py",
        "test_benchmarks_speed.py": "benchmarks/test_speed.py",
    }  # test_trainer.py tests ftrain/trainer.py, at the root: it stays
    why = {short(old): reason for old, reason in unplaced}
    assert set(why) == {"test_net.py", "test_gadget.py"}
    assert "models/net, recipes/net" in why["test_net.py"]
    assert "'gadget'" in why["test_gadget.py"]


def test_a_taken_place_is_refused(tmp_path):
    make_repo(tmp_path)
    (tmp_path / "tests" / "optim").mkdir()
    (tmp_path / "tests" / "optim" / "test_adam.py").write_text("")
    moves, unplaced = mirror.plan(tmp_path)
    assert "test_optim_adam.py" not in {short(m.old) for m in moves}
    why = {short(old): reason for old, reason in unplaced}
    assert why["test_optim_adam.py"].endswith("optim/test_adam.py is taken (it exists)")


def test_parents_are_counted_from_the_new_depth():
    def text(a, b):
        return f"A = Path(__file__).resolve().parents[{a}]\nB = Path(__file__).parents[{b}] / 'x'\n"

    assert mirror.rewrite_depth(text(1, 2), 1) == text(2, 3)
    assert mirror.rewrite_depth(text(2, 3), -1) == text(1, 2)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_moves_rewrites_and_follows_modules_that_move(tmp_path):
    root = make_repo(tmp_path)

    def git(*args):
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)

    git("init", "-q")
    git("add", ".")
    mirror.main(["--root", str(root)])
    moved = root / "tests" / "docs" / "test_intro.py"
    assert moved.read_text() == doc_line(2)
    assert (root / "tests" / "io" / "test_layout.py").read_text() == import_line("io.test_layout")
    assert (root / "docs" / "intro.md").read_text() == "checked by `tests/docs/test_intro.py`\n"
    io = "io"  # every io test moved to tests/io/; not every tests/test_*.py moved there
    assert (root / "docs" / "io.md").read_text() == f"tests/{io}/test_*.py, tests/test_*.py\n"
    pyproject = (root / "pyproject.toml").read_text()
    assert 'pythonpath = ["tests"]' in pyproject and "--import-mode=importlib" in pyproject
    assert 'known-local-folder = ["_tiny"]' in pyproject
    assert mirror.plan(root)[0] == []  # a second run moves nothing

    for package in ("app", "internals"):
        (root / "ftrain" / package).mkdir()
    git("mv", "ftrain/trainer.py", "ftrain/app/trainer.py")
    git("mv", "ftrain/scopes.py", "ftrain/internals/scopes.py")
    git("mv", "ftrain/distributed", "ftrain/parallel")
    (root / "tests" / "test_scopes.py").write_text("")
    git("add", ".")
    moves, _ = mirror.plan(root)
    assert {(short(m.old), short(m.new)) for m in moves} == {
        ("test_trainer.py", "app/test_trainer.py"),
        ("test_scopes.py", "internals/test_scopes.py"),
        ("distributed/test_tp_mesh.py", "parallel/test_tp_mesh.py"),
    }
