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

Timing: every side runs one step per round, the order rotating, and each ratio is a ratio of
medians over rounds, so a machine shared with other work slows all sides alike.
Targets are judged on CPU time (this process, all threads), which waiting for a core does not
inflate; wall time is shown beside it. One thread by default: with two threads on a busy 2-core
machine OpenMP's threads spin while they wait for each other, and that spinning is CPU time too.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import machine, write_section  # benchmarks/_common.py, beside this script

import ftrain as ft
from ftrain.models import GPT, GPTConfig

SECTION = "Step overhead"  # the section of benchmarks/RESULTS.md this script writes
LR, WD = 1e-3, 0.01
SIZES = {  # name: (d_model, n_layer, seq_len, batch, target for donate=True)
    "compute-bound": (256, 4, 128, 16, 1.02),
    "overhead-bound": (64, 2, 32, 8, 1.15),
}
# Where the rest goes: measured separately, with the same interleaving, when this was written.
NOTES = """Where the donated step's remaining overhead goes at the overhead-bound size: `ft.apply` swaps
the params into the module through a per-module plan built once (tied places, owners, shapes),
checked by identity on each call: about 25-75 µs over a plain module call (it was about 330 µs
through `torch.func.functional_call`, which re-derives the tied-weight map every call; the ratio
went from 1.08 to 1.05). Flattening and rebuilding TensorDicts is about 50 µs; dividing the
gradients by the token count and the gradient norm the metrics report about 70 µs. The pure step
costs more than the donated one because it allocates new params and moments every step: on this
CPU a fresh multi-megabyte tensor costs several times an in-place pass over it. In isolation
ftrain's AdamW is a chain of multi-tensor kernels (optax-style building blocks); torch's fused
AdamW is one pass per tensor, about 3x faster than either foreach version."""
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


def rounds(fns: dict[str, Callable[[], None]], n_rounds: int) -> dict[str, dict]:
    """Median wall and CPU seconds per call of each function over ``n_rounds`` rounds, each
    round one call of every function, the order rotating from round to round (A B C, B C A, ...):
    a change in machine load lands on all of them alike."""
    for f in fns.values():  # warm-up: first-call allocations, lazy inits
        f()
        f()
    names = list(fns)
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for r in range(n_rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            w, c = time.perf_counter(), time.process_time()
            fns[k]()
            cpu[k].append(time.process_time() - c)
            wall[k].append(time.perf_counter() - w)
    return {
        k: {"wall": statistics.median(wall[k]), "cpu": statistics.median(cpu[k])} for k in names
    }


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
        "--only", choices=sorted(SIZES), help="measure one size (nothing written to RESULTS.md)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes, n_rounds = (QUICK, 3) if args.quick else (SIZES, args.rounds)
    if args.only:
        sizes = {args.only: sizes[args.only]}
    load = os.getloadavg()[0]
    print(machine(), f"load {load:.1f}", flush=True)

    ratio_rows, time_rows = step_rows(sizes, n_rounds)
    opt_rows = update_rows(sizes, n_rounds)
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
"""
    if args.quick or args.only:
        print(body)
    else:
        write_section(SECTION, body)
        print(f"wrote the {SECTION!r} section of benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
