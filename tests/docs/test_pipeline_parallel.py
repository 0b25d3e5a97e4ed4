"""docs/pipeline-parallel.md: its ```python block runs (one 2-process spawn: pp = 2, 1F1B, the
state put back together equal to one process); the ```py blocks show layouts that
tests/transforms/test_pipeline.py runs (dp x pp on 4 processes, checkpoints loaded onto other
layouts)."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "pipeline-parallel.md"


def test_pipeline_parallel_guide_runs():
    env: dict = {"__name__": "pipeline-parallel.md"}
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], str(DOC), "exec"), env)
    first, last = env["keys"]
    assert "wpe.weight" in first and "wpe.weight" not in last  # positions: first stage only
    assert "ln_f.weight" in last and "ln_f.weight" not in first
