"""Bytes of optimizer state per parameter, for every ftrain optimizer, on the default GPT.

    python benchmarks/optimizers.py     # writes the "Optimizer memory" section of RESULTS.md

torch.optim's AdamW is measured beside it (its state after one step) as the reference for 8 bytes.
"""

from __future__ import annotations

import torch
from _common import machine, write_section

import ftrain as ft
from ftrain import optim
from ftrain.config import TrainConfig
from ftrain.optim.lamb import lamb
from ftrain.optim.quantized import adamw8bit
from ftrain.recipes.gpt import build_model

TARGETS = {"adamw": "8", "adafactor": "≤ 4.1", "adamw8bit": "≤ 2.1"}


def main() -> None:
    model = build_model(TrainConfig())
    params = ft.params_of(model)
    n = sum(p.numel() for p in params.values(True, True))
    big = sum(p.numel() for p in params.values(True, True) if p.numel() >= 4096) / n
    opts = {
        "sgd (momentum)": optim.sgd(0.1, momentum=0.9),
        "adam": optim.adam(1e-3),
        "adamw": optim.adamw(1e-3),
        "adafactor": optim.adafactor(1e-2),
        "lion": optim.lion(1e-4),
        "lamb": lamb(1e-3),
        "adamw8bit": adamw8bit(1e-3),
    }
    rows = []
    for name, opt in opts.items():
        b = optim.state_bytes(opt.init(params)) / n
        target = TARGETS.get(name.split()[0], "")
        ok = "" if not target else ("yes" if b <= float(target.strip("≤ ")) + 1e-3 else "**no**")
        rows.append(f"| {name} | {b:.3f} | {target} | {ok} |")
    ref = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ref.step()
    tb = (
        sum(
            t.numel() * t.element_size()
            for s in ref.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        / n
    )
    rows.append(f"| torch.optim.AdamW (reference) | {tb:.3f} | | |")
    body = f"""`python benchmarks/optimizers.py` on {machine()}.

Default `ftrain train` GPT: {n:,} parameters, {big:.0%} of them in tensors of at least 4096 elements.
State bytes include every counter; 8-bit AdamW keeps tensors under 4096 elements in fp32.

| optimizer | bytes of state per parameter | target | met |
| --- | ---: | ---: | :---: |
{chr(10).join(rows)}
"""
    print(body)
    write_section("Optimizer memory", body)


if __name__ == "__main__":
    main()
