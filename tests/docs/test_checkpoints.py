"""docs/checkpoints.md: its ```python blocks run as one script (the ```py block shows what runs
under torchrun; test_io_reshard.py checks it across processes)."""

import re
from pathlib import Path

import ftrain as ft

DOC = Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md"


def test_checkpoints_guide_runs():
    env: dict = {"__name__": "checkpoints.md"}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S):
        exec(compile(block, str(DOC), "exec"), env)
    assert [p.name for p in ft.list_checkpoints(env["run"])] == ["checkpoint-3", "checkpoint-6"]
    assert int(ft.load(env["run"] / "manual").step) == 6
    assert len(env["split"]) > 1
