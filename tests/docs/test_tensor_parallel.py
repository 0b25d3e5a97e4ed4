"""docs/tensor-parallel.md: its ```python blocks run as one script (one 2-process spawn; the ```py
block shows the 2 x 2 layout that test_transforms_tensor_parallel.py runs on 4 processes)."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "tensor-parallel.md"


def test_tensor_parallel_guide_runs():
    env: dict = {"__name__": "tensor-parallel.md"}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S):
        exec(compile(block, str(DOC), "exec"), env)
    assert len(env["losses"]) == 2 and env["splits"]["up.bias"].dim == 0
