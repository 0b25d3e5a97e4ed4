"""The AdamW update alone: ftrain fused and foreach against torch.optim.AdamW fused and foreach,
on GPT-2 124M's parameter shapes; and where an ftrain step's update phase spends its time.

    python benchmarks/fused.py                   # CPU, GPT-2 124M shapes; ~2 minutes; writes RESULTS.md
    python benchmarks/fused.py --device cuda     # on a GPU (the target: ftrain fused <= 1.1x torch fused)
    python benchmarks/fused.py --quick           # a smoke run at a tiny size, nothing written

Sides, each one AdamW update (lr 6e-4, betas 0.9/0.95, weight decay 0.1, decay on every tensor)
of the same params and gradients:

* **ftrain fused, update_and_apply** / **ftrain foreach**: ``optim.update_and_apply(opt, grads,
  state, params, inplace=True)``, what a donated ``ft.train_step`` runs after the gradients, with
  ``ft.optim.adamw(..., fused=None)`` (torch's fused kernel writing the params, as torch.optim's
  does) and ``fused=False`` (the foreach chain, then ``params + updates``);
* **ftrain fused**: ``opt.update(grads, state, params, inplace=True)`` then
  ``optim.apply_updates(params, updates, inplace=True)``: the optax-style two calls, where the
  kernel writes the update into a fresh params-sized buffer first;
* **torch fused** / **torch foreach**: ``torch.optim.AdamW(..., fused=True | foreach=True).step()``
  with the gradients in ``.grad``.

The shapes are GPT-2 small's (12 blocks, 768 wide, vocab 50304, block 1024, head tied to the
embedding): 124.5 M parameters in 148 tensors, 0.5 GB per fp32 copy. Every side runs once per round,
the order rotating, medians over rounds; on the CPU both wall and CPU time (this process, all
threads; one torch thread by default, as benchmarks/step_overhead.py explains), on CUDA the wall
time between synchronizations.

``--step`` also profiles one donated step of ``ftrain train``'s recipe GPT (torch.profiler, self
CPU time per op, ``adamw`` fused against ``fused=False``) to show what the update phase of a step
costs beyond the optimizer call: the division by the token count, the gradient norm of the
metrics, the clip, allocations.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from _common import machine, write_section  # beside this script

import ftrain as ft
from ftrain import optim

LR, BETAS, WD = 6e-4, (0.9, 0.95), 0.1


def gpt2_shapes(n_layer: int = 12, d: int = 768, vocab: int = 50304, block: int = 1024) -> dict:
    """GPT-2's parameter shapes by name (the head is tied to ``wte``)."""
    shapes = {"wte.weight": (vocab, d), "wpe.weight": (block, d)}
    for i in range(n_layer):
        b = f"h.{i}."
        shapes |= {b + "ln_1.weight": (d,), b + "ln_1.bias": (d,)}
        shapes |= {b + "attn.c_attn.weight": (3 * d, d), b + "attn.c_attn.bias": (3 * d,)}
        shapes |= {b + "attn.c_proj.weight": (d, d), b + "attn.c_proj.bias": (d,)}
        shapes |= {b + "ln_2.weight": (d,), b + "ln_2.bias": (d,)}
        shapes |= {b + "mlp.c_fc.weight": (4 * d, d), b + "mlp.c_fc.bias": (4 * d,)}
        shapes |= {b + "mlp.c_proj.weight": (d, 4 * d), b + "mlp.c_proj.bias": (d,)}
    return shapes | {"ln_f.weight": (d,), "ln_f.bias": (d,)}


def sides(shapes: dict, device: str) -> dict[str, Callable[[], None]]:
    g = torch.Generator(device).manual_seed(0)

    def randn(shape, scale):
        return torch.randn(shape, generator=g, device=device) * scale

    params = {k: randn(s, 0.02) for k, s in shapes.items()}
    grads = {k: randn(s, 1e-3) for k, s in shapes.items()}

    def ftrain_side(fused: bool, apply: bool = False) -> Callable[[], None]:
        opt = optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], weight_decay=WD, fused=fused)
        p = ft.tree.from_flat({k: v.clone() for k, v in params.items()})
        held = {"state": opt.init(p)}

        def update() -> None:
            # inplace=True may use the gradients as workspace, as a donated step does with its
            # fresh ones: give it a copy each time (copied before the clock starts, see below)
            g = held.pop("grads")
            if apply:  # the kernel writes the params
                _, held["state"] = optim.update_and_apply(opt, g, held["state"], p, inplace=True)
                return
            updates, held["state"] = opt.update(g, held["state"], p, inplace=True)
            optim.apply_updates(p, updates, inplace=True)

        def fresh_grads() -> None:
            held["grads"] = ft.tree.from_flat({k: v.clone() for k, v in grads.items()})

        update.before = fresh_grads  # type: ignore[attr-defined]
        return update

    def torch_side(**kw) -> Callable[[], None]:
        ps = [torch.nn.Parameter(v.clone()) for v in params.values()]
        for p, gr in zip(ps, grads.values()):
            p.grad = gr.clone()
        return torch.optim.AdamW(ps, lr=LR, betas=BETAS, weight_decay=WD, **kw).step

    return {
        "ftrain fused, update_and_apply": ftrain_side(True, apply=True),
        "ftrain fused": ftrain_side(True),
        "ftrain foreach": ftrain_side(False),
        "torch fused": torch_side(fused=True),
        "torch foreach": torch_side(foreach=True),
    }


def timed(fns: dict[str, Callable[[], None]], n_rounds: int, device: str) -> dict[str, dict]:
    """Median wall and CPU seconds per call, rounds in rotating order (see module docstring)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    names = list(fns)
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for r in range(-2, n_rounds):  # two warm-up rounds
        for k in names[r % len(names) :] + names[: r % len(names)]:
            getattr(fns[k], "before", lambda: None)()
            sync()
            w, c = time.perf_counter(), time.process_time()
            fns[k]()
            sync()
            if r >= 0:
                cpu[k].append(time.process_time() - c)
                wall[k].append(time.perf_counter() - w)
    return {
        k: {"wall": statistics.median(wall[k]), "cpu": statistics.median(cpu[k])} for k in names
    }


def update_table(shapes: dict, device: str, n_rounds: int) -> list[str]:
    n = sum(torch.Size(s).numel() for s in shapes.values())
    t = timed(sides(shapes, device), n_rounds, device)
    base = t["torch fused"]
    rows = [
        f"AdamW update alone on {device}, {n / 1e6:.1f} M params in {len(shapes)} tensors; "
        f"median of {n_rounds} rounds. Ratios to torch fused.",
        "",
        "| side | wall ms | / torch fused | CPU ms | / torch fused |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for k, v in t.items():
        rows.append(
            f"| {k} | {v['wall'] * 1e3:.1f} | {v['wall'] / base['wall']:.2f} | "
            f"{v['cpu'] * 1e3:.1f} | {v['cpu'] / base['cpu']:.2f} |"
        )
    print("\n".join(rows), flush=True)
    return rows


def update_ops(fn: Callable[[], None], steps: int) -> dict[str, float]:
    """CPU µs per step spent in each multi-tensor op (``aten::_foreach_*``, ``aten::_fused_*``,
    inclusive of the per-tensor ops they run on the CPU) and in allocating zeroed buffers."""
    from torch.profiler import ProfilerActivity, profile

    fn(), fn()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.key.startswith(("aten::_foreach_", "aten::_fused_")) or e.key == "aten::zeros_like":
            out[e.key] = e.cpu_time_total / steps
    return out


def step_profile(quick: bool, steps: int) -> list[str]:
    """The update phase of one donated recipe step, op by op, ``adamw`` foreach against fused;
    and each side's whole step (interleaved rounds, no profiler)."""
    from _common import rounds

    from ftrain.app.config import TrainConfig
    from ftrain.app.recipes import gpt

    cfg = TrainConfig(max_steps=10, batch_size=4 if quick else 16)
    model = gpt.build_model(cfg)
    data = {
        "input": torch.randint(0, 256, (cfg.batch_size, cfg.seq_len)),
        "target": torch.randint(0, 256, (cfg.batch_size, cfg.seq_len)),
    }

    def side(fused: bool) -> Callable[[], None]:
        opt = optim.chain(  # what gpt.build_optimizer builds, the learning rate not injected
            optim.clip_by_global_norm(1.0),
            optim.adamw(3e-4, weight_decay=0.1, mask=optim.decay_mask, fused=fused),
        )
        step = ft.train_step(
            lambda p, b: ft.losses.cross_entropy(ft.apply(model, p, b["input"]), b["target"]),
            opt,
            donate=True,
        )
        held = {"state": ft.TrainState.create(ft.params_of(model), opt)}

        def run() -> None:
            held["state"], _ = step(held["state"], data)

        return run

    sides = {"foreach": side(False), "fused": side(True)}
    ops = {k: update_ops(f, steps) for k, f in sides.items()}
    whole = rounds(sides, steps)
    keys = sorted(ops["foreach"].keys() | ops["fused"].keys(), key=lambda k: -max(
        ops["foreach"].get(k, 0.0), ops["fused"].get(k, 0.0)))  # fmt: skip
    n = sum(p.numel() for p in model.parameters())
    rows = [
        f"The update phase of one donated step of the recipe GPT (d={cfg.d_model}, {cfg.n_layer} "
        f"blocks, seq {cfg.seq_len}, batch {cfg.batch_size}; {n / 1e6:.2f} M params): "
        "clip_by_global_norm(1.0) then adamw with the decay mask, foreach against fused. CPU µs "
        f"per step in each multi-tensor op (torch.profiler, inclusive, {steps} steps), then the "
        "whole step without the profiler (median of interleaved rounds).",
        "",
        "| op | adamw foreach | adamw fused |",
        "| --- | ---: | ---: |",
        *(
            f"| `{k}` | {ops['foreach'].get(k, 0.0):.0f} | {ops['fused'].get(k, 0.0):.0f} |"
            for k in keys
        ),
        f"| all of them | {sum(ops['foreach'].values()):.0f} | {sum(ops['fused'].values()):.0f} |",
        f"| **whole step** (CPU µs) | {whole['foreach']['cpu'] * 1e6:.0f} | "
        f"{whole['fused']['cpu'] * 1e6:.0f} |",
    ]
    print("\n".join(rows), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, nothing written")
    parser.add_argument("--step", action="store_true", help="also profile one recipe step")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads on the CPU (1: see step_overhead.py)"
    )
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available on this machine")
    shapes = gpt2_shapes(2, 64, 512, 128) if args.quick else gpt2_shapes()
    load = f"load average {os.getloadavg()[0]:.1f} at the start"
    head = f"`python benchmarks/fused.py --device {args.device}` on {machine()}; {load}."
    print(head, flush=True)
    rows = update_table(shapes, args.device, 3 if args.quick else args.rounds)
    if args.step:
        rows += ["", *step_profile(args.quick, 4 if args.quick else 30)]
    end = f"Load average {os.getloadavg()[0]:.1f} at the end."
    if not (args.quick or args.no_write):
        title = "Fused optimizer update" + ("" if args.device == "cpu" else f" ({args.device})")
        write_section(title, "\n".join([head, "", *rows, "", end]))


if __name__ == "__main__":
    main()
