"""docs/vmap.md: its code runs as one script and builds what it says."""

import re
import warnings
from pathlib import Path

import torch

import ftrain as ft

DOC = Path(__file__).resolve().parents[2] / "docs" / "vmap.md"


def test_vmap_guide_runs():
    env: dict = {"__name__": "vmap.md"}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*batching rule.*")
        for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S):
            exec(compile(block, str(DOC), "exec"), env)
    assert env["metrics"]["loss"].shape == (4,)
    assert torch.allclose(
        env["metrics"]["lr"].double(), torch.tensor(env["lrs"], dtype=torch.float64)
    )
    assert isinstance(env["alone"], ft.TrainState) and int(env["alone"].step) == 4
    assert env["state"].step.tolist() == [3, 3, 3, 3]
