"""Model FLOP utilization of the default GPT's training step, against this machine's measured
matmul peak, with the imperative PyTorch step beside it.

    python benchmarks/mfu.py            # writes the "MFU" section of benchmarks/RESULTS.md

MFU = (training FLOPs per token x tokens per second) / peak FLOP/s, where FLOPs per token is the
6N + 12LdT estimate (ftrain.models.flops_per_token) and the peak is the best fp32 matmul rate
measured here on large square matrices.
"""

from __future__ import annotations

import time

import torch
from _common import interleaved, machine, write_section

import ftrain as ft
from ftrain.config import TrainConfig
from ftrain.models import flops_per_token
from ftrain.train import build_model, build_optimizer, make_loss_fn


def matmul_peak(sizes=(1024, 2048, 3072), seconds=1.0) -> float:
    """Best fp32 FLOP/s over ``sizes`` (each timed for about ``seconds``)."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            reps += 1
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0))
    return best


def main() -> None:
    cfg = TrainConfig()  # the defaults of `ftrain train`
    model = build_model(cfg)
    opt = build_optimizer(cfg)
    state = {"s": ft.TrainState.create(ft.params_of(model), opt, seed=0)}
    step = ft.train_step(make_loss_fn(model), opt, donate=True)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 257, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    batch = {"input": toks[:, :-1], "target": toks[:, 1:]}

    ref = build_model(cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                foreach=True)  # fmt: skip

    def ftrain_step():
        state["s"], _ = step(state["s"], batch)

    def torch_step():
        logits = ref(batch["input"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["target"].flatten())
        ref_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.clip_grad)
        ref_opt.step()

    peak = matmul_peak()
    t = interleaved({"ftrain": ftrain_step, "torch": torch_step}, repeats=15)
    peak_after = matmul_peak()
    peak = max(peak, peak_after)
    tokens = cfg.batch_size * cfg.seq_len
    fpt = flops_per_token(model.config)
    rows = []
    for k in ("ftrain", "torch"):
        achieved = fpt * tokens / t[k]
        rows.append(f"| {k} | {t[k] * 1e3:.0f} | {tokens / t[k]:.0f} | {achieved / 1e9:.1f} | "
                    f"{achieved / peak:.2f} |")  # fmt: skip
    mfu = fpt * tokens / t["ftrain"] / peak
    body = f"""`python benchmarks/mfu.py` on {machine()}.

Default `ftrain train` model (d={cfg.d_model}, {cfg.n_layer} layers, seq {cfg.seq_len},
batch {cfg.batch_size}, fp32, AdamW + clipping), eager. FLOPs per token (6N + 12LdT):
{fpt / 1e6:.2f} M. Measured fp32 matmul peak (best of 1024-3072 square matmuls): {peak / 1e9:.1f}
GFLOP/s.

| step | ms | tokens/s | GFLOP/s | MFU |
| --- | ---: | ---: | ---: | ---: |
{chr(10).join(rows)}

MFU of the ftrain step: **{mfu:.2f}** (target ≥ 0.75: {"met" if mfu >= 0.75 else "**not met**"}).
ftrain / torch step time: {t["ftrain"] / t["torch"]:.3f}.
"""
    print(body)
    write_section("MFU", body)


if __name__ == "__main__":
    main()
