"""tests/_tiers.py, which marks the fast tier: a test is slow when its code, a helper or table it
names (to any depth) or a fixture it uses starts processes, compiles, ... ; not otherwise. Checked
on a module written here (its code is strings in this file, so this test stays fast)."""

import importlib.util

from _tiers import slow_reason

SAMPLE = """
import subprocess

import torch

from ftrain.distributed import run_distributed


def spawns():
    return run_distributed(print, 2)


def through_two_helpers():
    return middle()


def middle():
    return spawns()


CASES = [lambda: torch.compile(print)]


def reads_a_table():
    return CASES


def runs_a_child():
    subprocess.run(["true"])


def plain(x=1):
    return torch.ones(3) * x


def calls_plain():
    return plain(2)
"""


def load(tmp_path):
    (tmp_path / "sample.py").write_text(SAMPLE)
    spec = importlib.util.spec_from_file_location("sample", tmp_path / "sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_what_a_test_reaches_decides(tmp_path):
    m = load(tmp_path)
    assert slow_reason(m.through_two_helpers, root=tmp_path) == "starts processes: run_distributed"
    assert slow_reason(m.reads_a_table, root=tmp_path) == "compiles: torch.compile"
    assert slow_reason(m.runs_a_child, root=tmp_path).startswith("runs a subprocess")
    assert slow_reason(m.calls_plain, root=tmp_path) is None


def test_a_fixture_decides_by_its_code_or_its_name(tmp_path):
    m = load(tmp_path)
    assert slow_reason(m.plain, [m.spawns], root=tmp_path) == "starts processes: run_distributed"
    assert slow_reason(m.plain, fixture_names=["tiny_run"], root=tmp_path).endswith("tiny_run")
    assert slow_reason(m.plain, fixture_names=["tmp_path"], root=tmp_path) is None


def test_code_outside_the_root_is_not_read(tmp_path):
    m = load(tmp_path)
    assert slow_reason(m.through_two_helpers, root=tmp_path / "elsewhere") is None
