"""The README's Python example runs and does what it says; its commands match CI."""

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_python_example_trains():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    example = max(blocks, key=len)
    env: dict = {}
    exec(compile(example, "README.md", "exec"), env)
    state, metrics = env["state"], env["metrics"]
    assert int(state.step) == 20
    assert metrics["loss"].dim() == 0
    # 20 steps on one fixed batch of random tokens: the loss must fall well below uniform.
    assert float(metrics["loss"]) < 0.9 * torch.log(torch.tensor(257.0)).item()


def test_readme_test_command_is_what_ci_runs():
    commands = re.findall(r"```bash\n(.*?)```", README, re.S)
    test_cmd = next(c for c in commands if "pytest" in c).strip()
    ci = (ROOT / ".ci" / "run").read_text()
    # CI installs in steps (to pin torch first) but must end with the same test invocation.
    assert test_cmd.split("&&")[-1].strip() in ci
    assert "torch==2.13.0" in ci and '".[dev]"' in ci
    assert any("ftrain train" in c for c in commands)


def test_every_file_the_readme_names_is_in_the_repository():
    """Each Markdown file the README points to (a link or a name in backticks) is a file of this
    repository, at that path from its root."""
    named = set(re.findall(r"[\w./-]+\.md\b", README))
    assert "docs/transforms.md" in named
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, missing
