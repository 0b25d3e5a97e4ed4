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

MODULES = ["__init__", "loop", "scoped", "optim/__init__", "optim/fused", "optim/schedules",
           "io/layout", "memory/layout", "models/gpt", "recipes/gpt", "distributed/tp_layout"]  # fmt: skip
TESTS = ["optim_fused", "schedules", "io_layout", "memory_layout", "loop", "docs_lora", "readme",
         "gpt", "device", "distributed_tp_layout", "benchmarks_speed"]  # fmt: skip


def make_repo(root: Path) -> Path:
    for m in MODULES:
        (root / "ftrain" / f"{m}.py").parent.mkdir(parents=True, exist_ok=True)
        (root / "ftrain" / f"{m}.py").write_text("")
    (root / "tests").mkdir()
    for t in TESTS:
        (root / "tests" / f"test_{t}.py").write_text(
            'DOC = Path(__file__).resolve().parents[1] / "docs"\n'
        )
    (root / "tests" / "_tiny.py").write_text("")
    (root / "benchmarks").mkdir()
    (root / "docs").mkdir()
    (root / "docs" / "lora.md").write_text("checked by `tests/test_docs_lora.py`\n")
    (root / "pyproject.toml").write_text(
        '[tool.ruff.lint.isort]\nknown-local-folder = ["_old"]\n\n'
        '[tool.pytest.ini_options]\ntestpaths = ["tests"]\naddopts = ""\n'
    )
    return root


def test_the_plan_mirrors_the_package_and_names_what_it_cannot_place(tmp_path):
    moves, unplaced = mirror.plan(make_repo(tmp_path))
    assert {m.old.removeprefix("tests/"): m.new.removeprefix("tests/") for m in moves} == {
        "test_optim_fused.py": "optim/test_fused.py",
        "test_schedules.py": "optim/test_schedules.py",
        "test_io_layout.py": "io/test_layout.py",
        "test_memory_layout.py": "memory/test_layout.py",
        "test_docs_lora.py": "docs/test_lora.py",
        "test_readme.py": "docs/test_readme.py",
        "test_distributed_tp_layout.py": "distributed/test_tp_layout.py",
        "test_benchmarks_speed.py": "benchmarks/test_speed.py",
    }  # test_loop.py tests ftrain/loop.py, at the root: it stays
    why = dict(unplaced)
    assert set(why) == {"tests/test_gpt.py", "tests/test_device.py"}
    assert "models/gpt, recipes/gpt" in why["tests/test_gpt.py"]
    assert "'device'" in why["tests/test_device.py"]


def test_a_taken_place_is_refused(tmp_path):
    make_repo(tmp_path)
    (tmp_path / "tests" / "optim").mkdir()
    (tmp_path / "tests" / "optim" / "test_fused.py").write_text("")
    moves, unplaced = mirror.plan(tmp_path)
    assert "tests/test_optim_fused.py" not in {m.old for m in moves}
    assert (
        "tests/test_optim_fused.py",
        "tests/optim/test_fused.py is taken (it exists)",
    ) in unplaced


def test_parents_are_counted_from_the_new_depth():
    text = "A = Path(__file__).resolve().parents[1]\nB = Path(__file__).parents[2] / 'x'\n"
    assert mirror.rewrite_depth(text, 1) == (
        "A = Path(__file__).resolve().parents[2]\nB = Path(__file__).parents[3] / 'x'\n"
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_moves_rewrites_and_follows_modules_that_move(tmp_path):
    root = make_repo(tmp_path)

    def git(*args):
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)

    git("init", "-q")
    git("add", ".")
    mirror.main(["--root", str(root)])
    moved = root / "tests" / "docs" / "test_lora.py"
    assert moved.read_text() == 'DOC = Path(__file__).resolve().parents[2] / "docs"\n'
    assert (root / "docs" / "lora.md").read_text() == "checked by `tests/docs/test_lora.py`\n"
    pyproject = (root / "pyproject.toml").read_text()
    assert 'pythonpath = ["tests"]' in pyproject and "--import-mode=importlib" in pyproject
    assert 'known-local-folder = ["_tiny"]' in pyproject
    assert mirror.plan(root)[0] == []  # a second run moves nothing

    for package in ("app", "internals"):
        (root / "ftrain" / package).mkdir()
    git("mv", "ftrain/loop.py", "ftrain/app/loop.py")
    git("mv", "ftrain/scoped.py", "ftrain/internals/scoped.py")
    git("mv", "ftrain/distributed", "ftrain/parallel")
    (root / "tests" / "test_scoped.py").write_text("")
    git("add", "tests/test_scoped.py")
    moves, _ = mirror.plan(root)
    assert {(m.old, m.new) for m in moves} == {
        ("tests/test_loop.py", "tests/app/test_loop.py"),
        ("tests/test_scoped.py", "tests/internals/test_scoped.py"),
        ("tests/distributed/test_tp_layout.py", "tests/parallel/test_tp_layout.py"),
    }
