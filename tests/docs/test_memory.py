"""docs/memory.md: its code runs as one script and its claims hold."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "memory.md"


def test_memory_guide_runs():
    code = "\n".join(re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S))
    env: dict = {"__name__": "memory.md"}
    exec(compile(code, str(DOC), "exec"), env)
    assert env["why"].chosen.fits
    assert env["plan"].peak > env["plan"].state
    assert "peak" in str(env["report"])
