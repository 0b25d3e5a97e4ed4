"""Step overhead: the pure ftrain step against the imperative PyTorch loop, same model and data.

    python benchmarks/step_overhead.py              # ~5 minutes on a 2-core CPU; writes RESULTS.md
    python benchmarks/step_overhead.py --quick      # a smoke run, nothing written
    python benchmarks/step_overhead.py --threads 2  # both cores (on a quiet machine)

Sides, each on ftrain's GPT (dropout 0, tied embeddings) with AdamW(lr 1e-3, weight decay 0.01):

* **torch**: ``opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()`` with
  ``torch.optim.AdamW(foreach=True)``, the usual imperative loop;
* **ftrain**: ``state, metrics = step(state, batch)`` with ``ft.train_step(loss_fn,
  ft.optim.adamw(...))``, eager, pure (``donate=False``: a new state every step) and donated
  (``donate=True``: params and moments updated in place, as ``torch.optim`` does). The ftrain
  step also computes metrics the torch loop does not (the gradient norm, the token count).

Two sizes: compute-bound (d=256, 4 blocks, seq 128, batch 16), where the step is matmuls and any
fixed cost should vanish (target <= 1.02), and overhead-bound (d=64, 2 blocks, seq 32, batch 8),
where Python and per-tensor kernel launches are a large part of the step (target <= 1.15). The
targets refer to ``donate=True``, the like-for-like comparison with ``torch.optim``'s in-place
update; ``donate=False`` is reported beside it. Then the optimizer update alone: ftrain's AdamW
(pure, and in place) against ``torch.optim.AdamW`` foreach and fused ``.step()``.

nanoGPT's CPU "baby GPT" (``--only nanogpt-baby``; vocab 65, 4 layers, 128 wide, block 64, batch
12, AdamW with a per-step learning rate, decay on matrices, clipping): ftrain's step against the
same model's imperative loop with the AdamW nanoGPT builds on a CPU (target <= 1.05) and with
``foreach=True``. ``--profile`` adds torch.profiler's self CPU time per op and step, both sides.

Timing: every side runs one step per round, the order rotating, and each ratio is a ratio of
medians over rounds, so a machine shared with other work slows all sides alike.
Targets are judged on CPU time (this process, all threads), which waiting for a core does not
inflate; wall time is shown beside it. One thread by default: with two threads on a busy 2-core
machine OpenMP's threads spin while they wait for each other, and that spinning is CPU time too.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import (  # benchmarks/_common.py, beside this script
    machine,
    profile_diff,
    rounds,
    write_section,
)

import ftrain as ft
from ftrain.models import GPT, GPTConfig

SECTION = "Step overhead"  # the section of benchmarks/RESULTS.md this script writes
LR, WD = 1e-3, 0.01
SIZES = {  # name: (d_model, n_layer, seq_len, batch, target for donate=True)
    "compute-bound": (256, 4, 128, 16, 1.02),
    "overhead-bound": (64, 2, 32, 8, 1.15),
}
# Where the rest goes: measured separately with the same interleaving (this script does not
# measure it; the numbers are the text below).
NOTES = """Where the donated step's remaining overhead goes at the overhead-bound size: `ft.apply` swaps
the params into the module through a per-module plan built once (tied places, owners, shapes),
checked by identity on each call: about 25-75 µs over a plain module call. Flattening and
rebuilding TensorDicts is about 50 µs; dividing the gradients by the token count and the gradient
norm the metrics report about 70 µs. The pure step costs more than the donated one because it
allocates new params and moments every step: on this CPU a fresh multi-megabyte tensor costs
several times an in-place pass over it. In isolation ftrain's AdamW is a chain of multi-tensor
kernels (optax-style building blocks); torch's fused AdamW is one pass per tensor, about 3x faster
than either foreach version."""
# nanoGPT's baby GPT on shakespeare_char (its README's CPU run): the config and its AdamW.
BABY = dict(vocab=65, d=128, n_layer=4, n_head=4, seq=64, batch=12, target=1.05)
BABY_LR, BABY_MIN_LR, BABY_WD, BABY_CLIP, BABY_WARMUP, BABY_ITERS = 1e-3, 1e-4, 0.1, 1.0, 100, 2000
BABY_TEXT = """
### nanoGPT's baby GPT

`--only nanogpt-baby`: vocab 65, 4 layers, 128 wide, block 64, batch 12, AdamW (betas 0.9/0.99,
weight decay 0.1 on matrices, the learning rate set every step), clipped at norm 1. `torch` is the
imperative loop with the AdamW nanoGPT builds on a CPU (torch's default: a loop over tensors),
`torch foreach` the multi-tensor one. Medians of {n} interleaved rounds; load {load:.1f} at the end.

| ratio | CPU time (judged) | wall time | target | met |
| --- | ---: | ---: | ---: | :---: |
{rows}

| | torch | torch foreach | ftrain donate | ftrain |
| --- | ---: | ---: | ---: | ---: |
{times}
"""
BABY_PROFILE = """
Where the time goes (`--profile`, torch.profiler, 20 steps each, alternating): self CPU µs per step of the ops
where ftrain's donated step and torch's loop differ most, and the time outside any op. The
profiler's own cost per op inflates both totals: read the differences.

| op | torch µs | ftrain donate µs | difference |
| --- | ---: | ---: | ---: |
{rows}
"""
SMALL_ROUNDS = 20  # times more rounds for the millisecond-long calls: medians of many short calls
QUICK = {"compute-bound": (64, 2, 32, 8, 1.02), "overhead-bound": (32, 1, 16, 4, 1.15)}


def gpt(d: int, n_layer: int, seq: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(d_model=d, n_layer=n_layer, n_head=4, seq_len=seq, dropout=0.0))


def batch(vocab: int, rows: int, seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "input": torch.randint(0, vocab, (rows, seq), generator=g),
        "target": torch.randint(0, vocab, (rows, seq), generator=g),
    }


# -- the three sides -------------------------------------------------------------------------------


def torch_side(model: GPT, data: dict) -> Callable[[], None]:
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)
    x, y = data["input"], data["target"]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logits = model(x)  # (B, T, vocab)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        opt.step()

    return step


def ftrain_side(model: GPT, data: dict, donate: bool) -> Callable[[], None]:
    def loss_fn(params, b):
        return ft.losses.cross_entropy(ft.apply(model, params, b["input"]), b["target"])

    opt = ft.optim.adamw(LR, weight_decay=WD)
    step = ft.train_step(loss_fn, opt, donate=donate)
    box = [ft.TrainState.create(ft.params_of(model), opt)]

    def run() -> None:
        box[0], _ = step(box[0], data)

    return run


# -- timing ----------------------------------------------------------------------------------------


def step_rows(sizes: dict, n_rounds: int) -> tuple[list[str], list[str]]:
    ratio_rows, time_rows = [], []
    for name, (d, n_layer, seq, rows, target) in sizes.items():
        model = gpt(d, n_layer, seq)
        data = batch(model.config.vocab_size, rows, seq)
        fns = {
            "torch": torch_side(model, data),
            "ftrain": ftrain_side(model, data, donate=False),
            "ftrain donate": ftrain_side(model, data, donate=True),
        }
        t = rounds(fns, n_rounds if d >= 256 else SMALL_ROUNDS * n_rounds)
        shape = f"d={d}, {n_layer} blocks, seq {seq}, batch {rows}"
        for side, tgt in (("ftrain donate", target), ("ftrain", None)):
            cpu = t[side]["cpu"] / t["torch"]["cpu"]
            wall = t[side]["wall"] / t["torch"]["wall"]
            judged = f"≤ {tgt}" if tgt else ""
            met = ("yes" if cpu <= tgt else "**no**") if tgt else ""
            ratio_rows.append(
                f"| {name} ({shape}) | {side} / torch | {cpu:.3f} | {wall:.3f} | {judged} | {met} |"
            )
        ms = {k: (v["cpu"] * 1e3, v["wall"] * 1e3) for k, v in t.items()}
        time_rows.append(
            f"| {name} | {ms['torch'][0]:.2f} | {ms['ftrain donate'][0]:.2f} | "
            f"{ms['ftrain'][0]:.2f} | {(t['ftrain donate']['cpu'] - t['torch']['cpu']) * 1e6:.0f} |"
        )
        print(ratio_rows[-2], ratio_rows[-1], time_rows[-1], sep="\n", flush=True)
    return ratio_rows, time_rows


# -- the optimizer update alone --------------------------------------------------------------------


def update_times(d: int, n_layer: int, seq: int, n_rounds: int) -> tuple[dict, int, int]:
    """CPU seconds of one AdamW update of a GPT's params, four ways."""
    model = gpt(d, n_layer, seq)
    g = torch.Generator().manual_seed(1)
    grads = ft.params_of(model).apply(lambda p: torch.randn(p.shape, generator=g) * 1e-3)
    opt = ft.optim.adamw(LR, weight_decay=WD)
    pure = {"params": ft.params_of(model)}
    pure["state"] = opt.init(pure["params"])
    donated = {"params": ft.params_of(model)}
    donated["state"] = opt.init(donated["params"])

    def ftrain_pure() -> None:
        updates, pure["state"] = opt.update(grads, pure["state"], pure["params"])
        pure["params"] = ft.optim.apply_updates(pure["params"], updates)

    def ftrain_inplace() -> None:
        # inplace=True may overwrite the gradients too (with the update): what a donated step
        # does with its freshly computed ones. Their values stay finite, which is all timing needs.
        updates, donated["state"] = opt.update(
            grads, donated["state"], donated["params"], inplace=True
        )
        ft.optim.apply_updates(donated["params"], updates, inplace=True)

    def torch_step(**kw) -> Callable[[], None]:
        m = copy.deepcopy(model)
        o = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, **kw)
        for p, gr in zip(m.parameters(), grads.values(True, True)):
            p.grad = gr.clone()
        return o.step

    fns = {
        "ftrain": ftrain_pure,
        "ftrain inplace": ftrain_inplace,
        "torch foreach": torch_step(foreach=True),
        "torch fused": torch_step(fused=True),
    }
    t = {k: v["cpu"] for k, v in rounds(fns, SMALL_ROUNDS * n_rounds).items()}
    return t, sum(p.numel() for p in model.parameters()), len(list(model.parameters()))


def update_rows(sizes: dict, n_rounds: int) -> list[str]:
    out = []
    for name, (d, n_layer, seq, _, _) in sizes.items():
        t, n, leaves = update_times(d, n_layer, seq, n_rounds)
        base = t["torch foreach"]
        cells = " | ".join(f"{v * 1e6:.0f} ({v / base:.2f})" for v in t.values())
        out.append(f"| {name} ({n / 1e6:.2f} M params, {leaves} tensors) | {cells} |")
        print(out[-1], flush=True)
    return out


# -- nanoGPT's baby GPT -------------------------------------------------------------------------


def baby_gpt(quick: bool) -> GPT:
    torch.manual_seed(0)
    d, n_layer = (32, 1) if quick else (BABY["d"], BABY["n_layer"])
    config = GPTConfig(vocab_size=BABY["vocab"], seq_len=BABY["seq"], d_model=d, n_layer=n_layer,
                       n_head=BABY["n_head"], bias=False, dropout=0.0)  # fmt: skip
    return GPT(config)


def baby_lr(it: int) -> float:
    """The learning rate at iteration ``it``: linear warmup, cosine to the minimum."""
    if it < BABY_WARMUP:
        return BABY_LR * it / BABY_WARMUP
    frac = min(1.0, (it - BABY_WARMUP) / (BABY_ITERS - BABY_WARMUP))
    return BABY_MIN_LR + 0.5 * (1 + math.cos(math.pi * frac)) * (BABY_LR - BABY_MIN_LR)


def baby_torch_side(model: GPT, data: dict, **adamw_kw) -> Callable[[], None]:
    model = copy.deepcopy(model)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": BABY_WD},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=BABY_LR, betas=(0.9, 0.99), **adamw_kw)
    x, y, it = data["input"], data["target"], [0]

    def step() -> None:
        for group in opt.param_groups:  # the schedule, set by hand every iteration
            group["lr"] = baby_lr(it[0])
        logits = model(x)  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, BABY_CLIP)
        opt.step()
        it[0] += 1

    return step


def baby_ftrain_side(model: GPT, data: dict, donate: bool) -> Callable[[], None]:
    def loss_fn(params, b):
        return ft.losses.cross_entropy(ft.apply(model, params, b["input"]), b["target"])

    schedule = ft.optim.warmup_cosine(BABY_LR, BABY_WARMUP, BABY_ITERS, end_value=BABY_MIN_LR)
    adamw = ft.optim.adamw(schedule, b2=0.99, weight_decay=BABY_WD, mask=ft.optim.decay_mask)
    opt = ft.optim.chain(ft.optim.clip_by_global_norm(BABY_CLIP), adamw)
    step = ft.train_step(loss_fn, opt, donate=donate)
    box = [ft.TrainState.create(ft.params_of(model), opt)]

    def run() -> None:
        box[0], _ = step(box[0], data)

    return run


def baby_sides(quick: bool) -> dict[str, Callable[[], None]]:
    model = baby_gpt(quick)
    data = batch(BABY["vocab"], BABY["batch"], BABY["seq"])
    return {
        "torch": baby_torch_side(model, data),  # nanoGPT's AdamW on a CPU: torch's default
        "torch foreach": baby_torch_side(model, data, foreach=True),
        "ftrain donate": baby_ftrain_side(model, data, donate=True),
        "ftrain": baby_ftrain_side(model, data, donate=False),
    }


def baby_rows(quick: bool, n_rounds: int) -> tuple[list[str], str]:
    t = rounds(baby_sides(quick), n_rounds)
    rows = []
    for side, base in (("ftrain donate", "torch"), ("ftrain donate", "torch foreach"),
                       ("ftrain", "torch"), ("torch foreach", "torch")):  # fmt: skip
        cpu, wall = (t[side][k] / t[base][k] for k in ("cpu", "wall"))
        judged = (side, base) == ("ftrain donate", "torch")
        target, met = ("", "")
        if judged:
            target, met = f"≤ {BABY['target']}", "yes" if cpu <= BABY["target"] else "**no**"
        rows.append(f"| {side} / {base} | {cpu:.3f} | {wall:.3f} | {target} | {met} |")
        print(rows[-1], flush=True)
    times = "| CPU ms per step | " + " | ".join(f"{t[k]['cpu'] * 1e3:.2f}" for k in t) + " |"
    print(times, flush=True)
    return rows, times


def baby_profile(quick: bool, steps: int = 20) -> list[str]:
    """Self CPU µs per step of each op (torch.profiler), ftrain donate against torch, the ops
    where they differ most first; and the time outside any op (Python, dispatch)."""
    sides = baby_sides(quick)
    return profile_diff(sides["torch"], sides["ftrain donate"], steps, top=12, chunk=5)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=11,
        help=f"rounds for the compute-bound step (default 11; {SMALL_ROUNDS}x for the rest)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 rounds, no write")
    parser.add_argument(
        "--only",
        choices=[*sorted(SIZES), "nanogpt-baby"],
        help="measure one size (nothing written to RESULTS.md)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile nanoGPT's baby GPT: where the time goes"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes, n_rounds = (QUICK, 3) if args.quick else (SIZES, args.rounds)
    if args.only:
        sizes = {args.only: sizes[args.only]} if args.only in sizes else {}
    load = os.getloadavg()[0]
    print(machine(), f"load {load:.1f}", flush=True)

    ratio_rows, time_rows = step_rows(sizes, n_rounds)
    opt_rows = update_rows(sizes, n_rounds)
    baby = ""
    if args.only in (None, "nanogpt-baby"):
        baby_n = 3 if args.quick else 10 * n_rounds
        rows, times = baby_rows(args.quick, baby_n)
        profile_rows = baby_profile(args.quick) if args.profile else []
        baby = BABY_TEXT.format(
            n=baby_n, rows="\n".join(rows), times=times, load=os.getloadavg()[0]
        )
        if profile_rows:
            baby += BABY_PROFILE.format(rows="\n".join(profile_rows))
    load_end = os.getloadavg()[0]
    body = f"""
`python benchmarks/step_overhead.py` on {machine()}. AdamW (lr 1e-3, weight decay 0.01) on
ftrain's GPT, eager. Medians over interleaved rounds, each round one call of every side in rotating
order ({n_rounds} rounds for the compute-bound step, {SMALL_ROUNDS * n_rounds} for the rest). Load
average {load:.1f} at the start and {load_end:.1f} at the end: the machine may be shared, so
targets are judged on CPU time (this process, all threads); wall time beside it. The targets refer
to `donate=True`, the in-place analogue of `torch.optim`; the pure step (`donate=False`, a new
state every step) is shown too.

| size | ratio | CPU time (judged) | wall time | target | met |
| --- | --- | ---: | ---: | ---: | :---: |
{chr(10).join(ratio_rows)}

CPU ms per step (and the donated step's overhead over torch, µs):

| size | torch | ftrain donate | ftrain | overhead µs |
| --- | ---: | ---: | ---: | ---: |
{chr(10).join(time_rows)}

The optimizer update alone, CPU µs per update (ratio to torch foreach): ftrain's `opt.update` +
`apply_updates` (pure: new params and state; in place: `inplace=True`) against
`torch.optim.AdamW(...).step()`.

| params | ftrain | ftrain inplace | torch foreach | torch fused |
| --- | ---: | ---: | ---: | ---: |
{chr(10).join(opt_rows)}

{NOTES}
{baby}"""
    if args.quick or args.only:
        print(body)
    else:
        write_section(SECTION, body)
        print(f"wrote the {SECTION!r} section of benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
