"""ft.memory and ft.fit on a GPU step planned without a GPU: GPT-2 1.5B, AdamW fp32, 24 GiB.

    python benchmarks/offload_plan.py     # about a minute on 2 cores; nothing is allocated

GPT-2 XL (48 blocks, d=1600, 25 heads, vocab 50257, seq 1024, batch 1) built on the meta device,
planned with ``device="cuda"`` (fake tensors; without a GPU ``meta`` stands in for it). Rows:
the step as it is, with ``ft.checkpoint(step, "blocks")``, and both with
``ft.offload(step, "optimizer")``: the device's bytes and the host's apart. Then ``ft.fit`` at
24 GiB (the checkpointed step fits, by 0.19 GiB) and at 22 GiB, which reaches offload only
because nothing on the device fits. Writes the ``Offload plan (fake CUDA)`` section of
RESULTS.md.
"""

from __future__ import annotations

import time

import torch
from _common import machine, write_section

import ftrain as ft
from ftrain.models import GPT, GPTConfig

BUDGET = 24 * 2**30
TIGHT = 22 * 2**30  # under every composition on the device: ft.fit must reach offload
GIB = 2**30


def gpt2_xl():
    """(step, params, batch) of GPT-2 1.5B with AdamW fp32, on the meta device (no bytes)."""
    cfg = GPTConfig(
        vocab_size=50257, seq_len=1024, d_model=1600, n_layer=48, n_head=25, matmul="torch"
    )  # 1.56e9 params, tied embeddings
    with torch.device("meta"):
        model = GPT(cfg)
    params = ft.params_of(model)

    def loss_fn(params, batch):
        return ft.losses.cross_entropy(ft.apply(model, params, batch["input"]), batch["target"])

    step = ft.train_step(loss_fn, ft.optim.adamw(3e-4), donate=True)  # as the recipe
    batch = {k: torch.empty(1, 1024, dtype=torch.long, device="meta") for k in ("input", "target")}
    return step, params, batch


def main() -> None:
    step, params, batch = gpt2_xl()
    rows = []
    for name, s in {
        "step": step,
        "checkpoint blocks": ft.checkpoint(step, "blocks"),
        "offload optimizer": ft.offload(step),
        "checkpoint blocks + offload optimizer": ft.offload(ft.checkpoint(step, "blocks")),
    }.items():
        start = time.perf_counter()
        r = ft.memory(s, params, batch, device="cuda")
        rows.append((name, r, time.perf_counter() - start))
    fits = []
    for budget in (BUDGET, TIGHT):
        start = time.perf_counter()
        _, fit = ft.fit(step, params, batch, budget, precisions=("fp32",), device="cuda")
        fits.append((budget, fit, time.perf_counter() - start))
    n = ft.param_count(params)
    lines = [
        f"GPT-2 1.5B ({n / 1e9:.2f}e9 params), AdamW fp32, batch 1 x 1024, planned on fake CUDA "
        f'(`device="cuda"`; the meta device stands in: this torch is a CPU build) by '
        f"`python benchmarks/offload_plan.py`, {machine()}. GiB; the device budget is 24 GiB.",
        "",
        "| step | device: params | grads | optimizer | peak | host: optimizer | host peak "
        "| fits 24 GiB | plan s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r, sec in rows:
        lines.append(
            f"| {name} | {r.params / GIB:.2f} | {r.gradients / GIB:.2f} | "
            f"{r.optimizer / GIB:.2f} | {r.peak / GIB:.2f} | {r.host_optimizer / GIB:.2f} | "
            f"{r.host_peak / GIB:.2f} | {'yes' if r.peak <= BUDGET else 'no'} | {sec:.1f} |"
        )
    for budget, fit, fit_s in fits:
        lines += [
            "",
            f"`ft.fit(step, ..., '{budget // GIB}GiB', precisions=('fp32',), device='cuda')` "
            f"({fit_s:.0f} s):",
            "",
            "```",
            str(fit),
            "```",
        ]
    print("\n".join(lines))
    write_section("Offload plan (fake CUDA)", "\n".join(lines))


if __name__ == "__main__":
    main()
