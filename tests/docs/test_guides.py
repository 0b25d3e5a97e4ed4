"""The guides' code runs, at a tiny size: docs/losses.md, docs/from-nanogpt.md (the imperative
loop and the ftrain one give the same losses) and docs/from-hf-trainer.md (likewise)."""

import re
import warnings
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def run_guide(name: str, tiny: dict[str, str]) -> dict:
    """Execute the guide's python blocks in order, in one namespace, with the settings in ``tiny``
    replaced (each must be found: a guide that changes its settings must change this test)."""
    text = (DOCS / name).read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
    for old, new in tiny.items():
        assert old in code, f"{name} no longer holds {old!r}"
        code = code.replace(old, new)
    env: dict = {"__name__": name}
    with warnings.catch_warnings():  # a guide may set filters
        exec(compile(code, str(DOCS / name), "exec"), env)
    return env


def test_losses_guide_runs():
    pytest.importorskip("transformers")
    env = run_guide("losses.md", {})
    assert int(env["metrics"]["count"]) == 10


def test_from_nanogpt_loops_give_the_same_losses():
    env = run_guide(
        "from-nanogpt.md",
        {
            "python_stdlib()[:20]": "python_stdlib()[:2]",
            "= 64, 12, 4, 4, 128": "= 16, 4, 1, 2, 32",
            "= 2000, 250, 20, 100": "= 8, 4, 2, 2",
        },
    )
    a, b = env["torch_losses"], env["ftrain_losses"]
    assert len(a) == len(b) == 8
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)
    assert env["val"]["batches"] == 2 and "perplexity" in env["val"]


def test_from_hf_trainer_loops_give_the_same_losses():
    pytest.importorskip("transformers")
    env = run_guide(
        "from-hf-trainer.md",
        {"= 64, 16, 4, 200, 20": "= 32, 8, 4, 6, 2", "python_stdlib()[:40]": "python_stdlib()[:1]"},
    )
    a, b = env["hf_losses"], env["ft_losses"]
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)
    # the micro-batches held different numbers of targets: the exactness was tested
    first = env["batches"][0]["labels"][:, 1:]
    assert len({int((m != -100).sum()) for m in first.tensor_split(4)}) > 1
