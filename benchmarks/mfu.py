"""Model FLOP utilization of the default GPT's training step, against this machine's measured
matmul peak, with the imperative PyTorch step beside it, and where the rest of the time goes.

    python benchmarks/mfu.py            # writes the "MFU" section of benchmarks/RESULTS.md

MFU = (training FLOPs per token x tokens per second) / peak FLOP/s, where FLOPs per token is the
6N + 12LdT estimate (ftrain.models.flops_per_token) and the peak is the best fp32 matmul rate
measured here on large square matrices.

The breakdown times, in isolation and in the same interleaved run, the two kinds of work the FLOP
count is made of: every matmul of the step at its real shape (forward, input-gradient and
weight-gradient of each Linear) and the attention kernel (forward + backward). Their sum is the
step time if everything else (LayerNorm, GELU, residual adds, loss, optimizer, framework) were
free, so ``FLOPs / (matmuls + attention) / peak`` is the MFU this model can reach with these
kernels on this machine.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import interleaved, machine, write_section

import ftrain as ft
from ftrain.config import TrainConfig
from ftrain.models import GPT, flops_per_token
from ftrain.train import build_model, build_optimizer, make_loss_fn

TARGET = 0.75


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


def matmuls_of(model: nn.Module, tokens: int):
    """A function running every matmul of one training step of ``model`` at its real shape."""
    ops = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            x = torch.randn(tokens, m.in_features)
            w = torch.randn(m.out_features, m.in_features)
            dy = torch.randn(tokens, m.out_features)
            b = torch.randn(m.out_features) if m.bias is not None else None
            ops.append((x, w, b, dy))

    def run():
        for x, w, b, dy in ops:
            F.linear(x, w, b)  # forward
            dy @ w  # gradient of the input
            dy.t() @ x  # gradient of the weight

    return run


def attention_of(cfg: TrainConfig):
    """A function running the step's attention kernels (forward + backward, every layer)."""
    hs = cfg.d_model // cfg.n_head
    q, k, v = (torch.randn(cfg.batch_size, cfg.n_head, cfg.seq_len, hs, requires_grad=True)
               for _ in range(3))  # fmt: skip
    dy = torch.randn(cfg.batch_size, cfg.n_head, cfg.seq_len, hs)

    def run():
        for _ in range(cfg.n_layer):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dy)

    return run


def main() -> None:
    cfg = TrainConfig()  # the defaults of `ftrain train`
    model = build_model(cfg)
    opt = build_optimizer(cfg)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 257, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    batch = {"input": toks[:, :-1], "target": toks[:, 1:]}
    tokens = cfg.batch_size * cfg.seq_len

    # The same width, depth and FLOPs with head size 64 (as GPT-2) and no biases: how much of the
    # gap is the model's shape (the CPU attention kernel prefers larger heads), not the framework.
    torch.manual_seed(cfg.seed)
    variant = GPT(dataclasses.replace(model.config, n_head=cfg.d_model // 64, bias=False))
    assert flops_per_token(variant.config) == flops_per_token(model.config)

    def ftrain_step_fn(compiled: bool, model: GPT = model):
        state = {"s": ft.TrainState.create(ft.params_of(model), opt, seed=0)}
        step = ft.train_step(make_loss_fn(model), opt, donate=True)
        if compiled:
            step = ft.compile(step)

        def run():
            state["s"], _ = step(state["s"], batch)

        return run

    ref = build_model(cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                foreach=True)  # fmt: skip

    def torch_step():
        logits = ref(batch["input"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten())
        ref_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.clip_grad)
        ref_opt.step()

    fns = {
        "ftrain": ftrain_step_fn(compiled=False),
        "torch": torch_step,
        "ftrain + ft.compile": ftrain_step_fn(compiled=True),
        "ftrain, head size 64, no biases": ftrain_step_fn(compiled=False, model=variant),
        "matmuls alone": matmuls_of(model, tokens),
        "attention alone": attention_of(cfg),
    }
    t0 = time.perf_counter()
    fns["ftrain + ft.compile"]()
    compile_s = time.perf_counter() - t0

    peak = matmul_peak()
    t = interleaved(fns, repeats=15)
    peak = max(peak, matmul_peak())
    fpt = flops_per_token(model.config)
    flops = fpt * tokens
    attn_flops = 12 * cfg.n_layer * cfg.d_model * cfg.seq_len * tokens
    mm_flops = flops - attn_flops

    rows = []
    for k in ("ftrain", "torch", "ftrain + ft.compile", "ftrain, head size 64, no biases"):
        achieved = flops / t[k]
        rows.append(f"| {k} | {t[k] * 1e3:.1f} | {tokens / t[k]:.0f} | {achieved / 1e9:.1f} | "
                    f"{achieved / peak:.2f} |")  # fmt: skip
    mfu = flops / t["ftrain"] / peak
    t_mm, t_attn = t["matmuls alone"], t["attention alone"]
    ceiling = flops / (t_mm + t_attn) / peak
    rest = t["ftrain"] - t_mm - t_attn
    share = lambda x: f"{x / t['ftrain']:.0%}"  # noqa: E731
    body = f"""`python benchmarks/mfu.py` on {machine()}.

Default `ftrain train` model (d={cfg.d_model}, {cfg.n_layer} layers, {cfg.n_head} heads, seq
{cfg.seq_len}, batch {cfg.batch_size}, fp32, AdamW + clipping). FLOPs per token (6N + 12LdT):
{fpt / 1e6:.2f} M. Measured fp32 matmul peak (best of 1024-3072 square matmuls): {peak / 1e9:.1f}
GFLOP/s.

| step | ms | tokens/s | GFLOP/s | MFU |
| --- | ---: | ---: | ---: | ---: |
{chr(10).join(rows)}

MFU of the ftrain step: **{mfu:.2f}** (target ≥ {TARGET}: {"met" if mfu >= TARGET else "**not met**"}).
ftrain / torch step time: {t["ftrain"] / t["torch"]:.3f}. The last row is not the default model:
same width, depth and FLOP count, {variant.config.n_head} heads of 64 and no biases. `ft.compile` took {compile_s:.0f} s to
compile.

Where the eager ftrain step's time goes (the first two timed alone, in the same interleaved run):

| part | ms | share of the step | GFLOP/s | of peak |
| --- | ---: | ---: | ---: | ---: |
| every matmul of the step at its real shape | {t_mm * 1e3:.1f} | {share(t_mm)} | {mm_flops / t_mm / 1e9:.1f} | {mm_flops / t_mm / peak:.2f} |
| attention kernel, forward + backward | {t_attn * 1e3:.1f} | {share(t_attn)} | {attn_flops / t_attn / 1e9:.1f} | {attn_flops / t_attn / peak:.2f} |
| everything else (norms, GELU, adds, loss, optimizer, framework) | {rest * 1e3:.1f} | {share(rest)} | | |

If everything else took no time at all, the step would reach MFU
**{ceiling:.2f}** = FLOPs / (matmuls + attention) / peak: the ceiling for this model with these
kernels on this machine. At d={cfg.d_model} the matmuls have an inner dimension of {cfg.d_model}
and reach only part of the square-matrix peak, and the CPU attention kernel (head size
{cfg.d_model // cfg.n_head}, T={cfg.seq_len}) runs its counted FLOPs at a fraction of the matmul rate.
"""
    print(body)
    write_section("MFU", body)


if __name__ == "__main__":
    main()
