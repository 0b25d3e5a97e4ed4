"""docs/lora.md runs as written: LoRA on a tiny GPT-2, merged, exported, loaded back."""

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "lora.md"


def test_the_lora_guide_runs_and_its_export_matches(capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    code = "\n".join(re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S))
    env: dict = {"__name__": "lora.md"}
    exec(compile(code, str(DOC), "exec"), env)
    # rank 4 on c_attn (32 -> 96), attn.c_proj (32 -> 32), mlp.c_proj (128 -> 32), 2 layers
    assert env["trained"] == 2 * 4 * ((32 + 96) + (32 + 32) + (128 + 32))
    printed = capsys.readouterr().out
    assert "peft: max" in printed
    diff = float(re.search(r"^max \|logits difference\|: (\S+)", printed, re.M).group(1))
    assert diff <= 1e-5
    peft_diff = float(re.search(r"peft: max \|logits difference\|: (\S+)", printed).group(1))
    assert peft_diff <= 1e-5
    # the adapters moved: the merged model is not the base
    base = env["state"].extra["lora", "base", "transformer", "h", "0", "attn", "c_attn", "weight"]
    assert (
        env["merged"]["transformer", "h", "0", "attn", "c_attn", "weight"] - base
    ).abs().max() > 0
