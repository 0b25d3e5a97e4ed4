"""Optimizers on the default ``ftrain train`` GPT: bytes of state, step time, the loss after the
same CPU time, and sharded Muon's two ways of getting whole matrices.

    python benchmarks/optimizers.py                # about 8 minutes on a 2-core CPU; writes RESULTS.md
    python benchmarks/optimizers.py --quick        # a smoke run at a tiny size, nothing written
    python benchmarks/optimizers.py --only sharded # one part (memory, speed, budget, sharded)

It writes four sections of RESULTS.md:

* **Optimizer memory**: bytes of optimizer state per parameter for every ftrain optimizer, with
  torch.optim's AdamW (its state after one step) as the reference for 8 bytes.
* **Optimizer step time**: the recipe's step (``ftrain.app.recipes.gpt``: ``build_model``,
  ``build_optimizer``, ``build_step``: clipping, the injected peak learning rate, weight decay on
  matrices; eager, donated, as ``ftrain train`` runs it) with ``--optimizer adamw``, ``muon``
  (``optim.muon_adamw``) and ``schedule_free_adamw``; then the optimizer update alone
  (``update`` + ``apply_updates``, in place) and Newton–Schulz alone.
* **Optimizer loss at equal CPU time**: each optimizer trains the recipe's model on the same
  batches of the built-in corpus for as many steps as fit in one CPU-time budget (its step time
  from the section above), its schedule spanning exactly those steps; the validation loss at the
  end (schedule-free at ``schedule_free_eval_params``), for each learning rate of a small sweep.
  The runs go two at a time in two processes (one torch thread each).
* **Sharded Muon**: on 2 gloo ranks, the two ways to orthogonalize updates that zero2/fsdp hold as
  row shards: every rank gathers every whole matrix and orthogonalizes all of them, or each rank
  is given whole matrices (their rows sent to it), orthogonalizes those and sends the rows back
  (``ftrain.distributed.data_parallel.owners.on_owners``, what ``ftrain.optim.muon`` does). The
  parts are timed and the bytes counted.

Timing follows benchmarks/step_overhead.py: one torch thread, every side once per round in
rotating order, medians over rounds, ratios judged on CPU time (this process, all threads; waiting
for a core does not inflate it), wall time beside. Collectives are judged on wall time (a rank
that waits for the other sleeps: that costs no CPU time but the step waits all the same).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import math
import multiprocessing
import os
import statistics
import time

import torch
from _common import machine, rounds, write_section  # benchmarks/_common.py, beside this script

import ftrain as ft
from ftrain import optim, tree
from ftrain.app.config import TrainConfig
from ftrain.app.loop import validation_loss
from ftrain.app.recipes import gpt
from ftrain.optim.lamb import lamb
from ftrain.optim.muon import newton_schulz
from ftrain.optim.quantized import adamw8bit

TARGETS = {"adamw": "8", "adafactor": "≤ 4.1", "adamw8bit": "≤ 2.1"}
NAMES = {"adamw": "adamw", "muon": "muon_adamw", "schedule_free_adamw": "schedule_free_adamw"}
LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)  # the peak learning rates tried for every optimizer
BUDGET_S = 60.0  # CPU seconds of training per run
EVAL_BATCHES = 32  # validation batches of batch_size rows: 65,536 tokens at the default size
QUICK = dict(d_model=32, n_layer=1, n_head=2, seq_len=32, batch_size=4, warmup=5)


def base_cfg(quick: bool, **kw) -> TrainConfig:
    """The default ``ftrain train`` settings (a tiny model with ``quick``)."""
    return TrainConfig(**(QUICK if quick else {}), **kw)


def recipe_state(cfg: TrainConfig, model=None):
    """The recipe's optimizer, step and state at step 0 for ``cfg`` (model: ``build_model``)."""
    model = gpt.build_model(cfg) if model is None else model
    opt = gpt.build_optimizer(cfg)
    step = gpt.build_step(cfg, model, opt)
    state = step.init_extra(ft.TrainState.create(ft.params_of(model), opt, seed=cfg.seed))
    return model, opt, step, state


def first_batches(cfg: TrainConfig, n: int) -> list[dict]:
    """The first ``n`` batches of the recipe's train loader: the same for every optimizer."""
    loader, _ = gpt.build_data(cfg, quiet=True)
    with iter(loader) as it:
        return [next(it) for _ in range(n)]


# -- memory ----------------------------------------------------------------------------------------


def memory_section(quick: bool) -> str:
    model = gpt.build_model(base_cfg(quick))
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
        "muon_adamw": optim.muon_adamw(1e-3),
        "schedule_free_adamw": optim.schedule_free_adamw(1e-3),
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
    return f"""`python benchmarks/optimizers.py` on {machine()}.

Default `ftrain train` GPT: {n:,} parameters, {big:.0%} of them in tensors of at least 4096 elements.
State bytes include every counter; 8-bit AdamW keeps tensors under 4096 elements in fp32. Muon's
momentum is one fp32 copy of the hidden matrices, AdamW's two moments cover the rest;
schedule-free AdamW keeps `z` and the second moment.

| optimizer | bytes of state per parameter | target | met |
| --- | ---: | ---: | :---: |
{chr(10).join(rows)}
"""


# -- step time -------------------------------------------------------------------------------------


def step_times(quick: bool, n_rounds: int) -> dict[str, dict]:
    """Median CPU and wall seconds of the recipe's donated eager step, per --optimizer name."""
    cfg = base_cfg(quick)
    model = gpt.build_model(cfg)
    batch = first_batches(cfg, 1)[0]
    fns = {}
    for name in NAMES:
        _, _, step, state = recipe_state(dataclasses.replace(cfg, optimizer=name), model)
        box = [state]

        def run(step=step, box=box) -> None:
            box[0], _ = step(box[0], batch)

        fns[name] = run
    return rounds(fns, n_rounds)


def hidden_groups(params) -> list[torch.Tensor]:
    """The hidden matrices of ``params`` (``muon_labels``), stacked by shape, as bfloat16."""
    labels = optim.muon_labels(params)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for path, p in tree.to_flat(params).items():
        if labels[tuple(path.split("."))] == "muon":
            groups.setdefault(tuple(p.shape), []).append(p.detach().bfloat16())
    return [torch.stack(v) for v in groups.values()]


def update_times(quick: bool, n_rounds: int) -> tuple[dict[str, dict], int, list]:
    """Median seconds of the recipe's optimizer update alone (``update`` + ``apply_updates``, in
    place, as the donated step runs them), per optimizer, and of Newton–Schulz alone on every
    hidden matrix. Each update call first copies fixed gradients into the gradient buffers (the
    step's backward writes them fresh; an in-place update overwrites them): the same copy for all."""
    cfg = base_cfg(quick)
    params0 = ft.params_of(gpt.build_model(cfg))
    g = torch.Generator().manual_seed(1)
    grads0 = params0.apply(lambda p: torch.randn(p.shape, generator=g) * 1e-2)
    fns = {}
    for name in NAMES:
        opt = gpt.build_optimizer(dataclasses.replace(cfg, optimizer=name))
        box = {"params": params0.clone(), "grads": grads0.clone()}
        box["state"] = opt.init(box["params"])
        src, dst = list(grads0.values(True, True)), list(box["grads"].values(True, True))

        def run(opt=opt, box=box, src=src, dst=dst) -> None:
            torch._foreach_copy_(dst, src)
            updates, box["state"] = opt.update(
                box["grads"], box["state"], box["params"], inplace=True
            )
            optim.apply_updates(box["params"], updates, inplace=True)

        fns[name] = run
    stacks = hidden_groups(grads0)
    fns["newton_schulz"] = lambda: [newton_schulz(s) for s in stacks]
    shapes = [(len(s), tuple(s.shape[1:])) for s in stacks]
    n = sum(p.numel() for p in params0.values(True, True))
    return rounds(fns, n_rounds), n, shapes


def speed_section(quick: bool, n_rounds: int, t: dict, load: tuple[float, float]) -> str:
    u, n, shapes = update_times(quick, 10 * n_rounds)
    rows = []
    for name, label in NAMES.items():
        rows.append(
            f"| {label} | {t[name]['cpu'] * 1e3:.1f} | {t[name]['cpu'] / t['adamw']['cpu']:.3f} | "
            f"{t[name]['wall'] * 1e3:.1f} | {t[name]['wall'] / t['adamw']['wall']:.3f} | "
            f"{u[name]['cpu'] * 1e3:.2f} | {u[name]['cpu'] / u['adamw']['cpu']:.2f} |"
        )
    ns, mu = u["newton_schulz"]["cpu"], u["muon"]["cpu"]
    hidden = ", ".join(f"{k} x {a}x{b}" for k, (a, b) in shapes)
    cfg = base_cfg(quick)
    return f"""`python benchmarks/optimizers.py` on {machine()}. Load average {load[0]:.1f} at the
start and {load[1]:.1f} at the end (a shared machine: ratios are judged on CPU time).

The recipe's step (`ftrain train --optimizer X`: d={cfg.d_model}, {cfg.n_layer} blocks, seq
{cfg.seq_len}, batch {cfg.batch_size}, {n:,} parameters, clipping at 1, weight decay 0.1 on
matrices, the injected peak learning rate; eager, donated). Medians of {n_rounds} interleaved
rounds for the step, {10 * n_rounds} for the update alone (`opt.update(..., inplace=True)` +
`apply_updates(..., inplace=True)` on fixed gradients, with the copy of those gradients into the
gradient buffers in every side alike).

| optimizer | step CPU ms | / adamw (judged) | step wall ms | / adamw | update CPU ms | / adamw |
| --- | ---: | ---: | ---: | ---: | ---: | ---: |
{chr(10).join(rows)}

Newton–Schulz alone (5 steps, bfloat16, batched by shape as `optim.muon` runs it) on the
{sum(k for k, _ in shapes)} hidden matrices ({hidden}): **{ns * 1e3:.2f} ms** CPU, {ns / mu:.0%} of
muon_adamw's update and {ns / t["muon"]["cpu"]:.1%} of its step. Muon's update costs
{(mu - u["adamw"]["cpu"]) * 1e3:.2f} ms more than AdamW's; the medians of the whole steps differ by
{(t["muon"]["cpu"] - t["adamw"]["cpu"]) * 1e3:+.1f} ms.
"""


# -- loss after the same CPU time ----------------------------------------------------------------


def train_for(name: str, lr: float, steps: int, quick: bool) -> dict:
    """Train the recipe's model with ``--optimizer name --lr lr`` for ``steps`` steps (its
    schedule spanning them) on the loader's first batches; the validation loss at the end."""
    torch.set_num_threads(1)
    cfg = base_cfg(quick, optimizer=name, lr=lr, max_steps=steps, eval_batches=EVAL_BATCHES)
    batches = first_batches(cfg, steps)
    model, _, step, state = recipe_state(cfg)
    losses = []
    cpu, wall = time.process_time(), time.perf_counter()
    for b in batches:
        state, metrics = step(state, b)
        losses.append(metrics["loss"])
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    train = torch.stack(losses[-20:]).mean().item()
    val = validation_loss(
        model, gpt.eval_params(cfg, state), gpt.build_data(cfg, quiet=True)[1], cfg
    )
    return dict(name=name, lr=lr, steps=steps, cpu=cpu, wall=wall, train=train, val=val)


def budget_runs(quick: bool, budget: float, t: dict) -> list[dict]:
    """Every optimizer at every learning rate of :data:`LRS`, each for the steps that fit in
    ``budget`` CPU seconds at its median step time; two processes at a time."""
    gpt.build_data(base_cfg(quick), quiet=True)  # the token cache, built once before the workers
    jobs = [
        (name, lr, max(1, round(budget / t[name]["cpu"]))) for name in NAMES for lr in LRS
    ]  # fmt: skip
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
        futures = [pool.submit(train_for, *job, quick) for job in jobs]
        out = []
        for f in futures:
            out.append(f.result())
            r = out[-1]
            print(f"{r['name']:20s} lr {r['lr']:g}: {r['steps']} steps, {r['cpu']:.1f} CPU s, "
                  f"val {r['val']:.4f}", flush=True)  # fmt: skip
    return out


def budget_section(quick: bool, budget: float, runs: list[dict], load: tuple) -> str:
    rows = []
    best = {}
    for name, label in NAMES.items():
        mine = {r["lr"]: r for r in runs if r["name"] == name}
        b = min(mine.values(), key=lambda r: r["val"])
        best[name] = b
        cells = " | ".join(
            f"**{mine[lr]['val']:.4f}**" if mine[lr] is b else f"{mine[lr]['val']:.4f}"
            for lr in LRS
        )
        cpu = [r["cpu"] for r in mine.values()]
        rows.append(
            f"| {label} | {b['steps']} | {min(cpu):.1f}-{max(cpu):.1f} | {cells} | {b['lr']:g} | "
            f"{b['train']:.4f} | {b['val']:.4f} |"
        )
    order = sorted(best, key=lambda k: best[k]["val"])
    ranking = " < ".join(f"{NAMES[k]} {best[k]['val']:.3f}" for k in order)
    cfg = base_cfg(quick)
    return f"""`python benchmarks/optimizers.py` on {machine()}. Load average {load[0]:.1f} at the
start and {load[1]:.1f} at the end.

Each optimizer trains the recipe's model (`ftrain train --optimizer X --lr LR --max-steps N`:
warmup {cfg.warmup}, then cosine to LR/10 over the N steps; schedule-free: warmup {cfg.warmup}, no
decay) on the same stream of batches (the built-in stdlib corpus, the loader's first N batches),
for the N steps that fit in **{budget:.0f} CPU seconds** at its median step time above (one torch
thread; two runs at a time in two processes). Validation loss (nats/byte) on the first
{EVAL_BATCHES * cfg.batch_size} validation rows ({EVAL_BATCHES * cfg.batch_size * cfg.seq_len:,}
tokens) at the end, schedule-free AdamW at its eval params (`schedule_free_eval_params`). The
sweep: peak learning rates {", ".join(f"{lr:g}" for lr in LRS)} for every optimizer, the best
in bold; it is chosen on the same validation loss it reports (the same advantage for all).

| optimizer | steps | CPU s used | val @ {" | val @ ".join(f"{lr:g}" for lr in LRS)} | best lr | train loss (last 20) | val loss |
| --- | ---: | ---: | {" | ".join("---:" for _ in LRS)} | ---: | ---: | ---: |
{chr(10).join(rows)}

At equal CPU time: {ranking}.
"""


# -- sharded Muon ----------------------------------------------------------------------------------


def _orthogonalize(mats: list[torch.Tensor]) -> list[torch.Tensor]:
    """Newton–Schulz of each matrix, batched by shape (as ``optim.muon``'s orthogonalize)."""
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(mats):
        groups.setdefault(tuple(m.shape), []).append(i)
    out: list[torch.Tensor] = [None] * len(mats)  # type: ignore[list-item]
    for idx in groups.values():
        for i, o in zip(idx, newton_schulz(torch.stack([mats[i] for i in idx])).unbind()):
            out[i] = o
    return out


def sharded_muon(quick: bool, n_rounds: int) -> dict:
    """On each rank: the parts of both schemes on the hidden matrices of the recipe's GPT, with
    updates held as zero2/fsdp hold them (Shard(0) DTensors), and the recipe's muon step under
    ddp, zero2 and fsdp. B is the library's ``on_owners`` (its parts: its ``Exchange``)."""
    import torch.distributed as dist

    from ftrain.distributed import default_mesh, shard_state
    from ftrain.distributed.collectives import as_sharded, gather_leaves, layout
    from ftrain.distributed.data_parallel.owners import exchange, on_owners, owners
    from ftrain.optim.muon import newton_schulz_cost

    torch.set_num_threads(1)
    mesh, rank, world = default_mesh(), dist.get_rank(), dist.get_world_size()
    group = mesh.get_group()
    cfg = base_cfg(quick)
    params = ft.params_of(gpt.build_model(cfg))
    labels = optim.muon_labels(params)
    paths = [k for k in tree.paths(params) if labels[tuple(k.split("."))] == "muon"]
    shapes = [tuple(tree.to_flat(params)[k].shape) for k in paths]
    g = torch.Generator().manual_seed(0)
    wholes = [torch.randn(s, generator=g) for s in shapes]  # the same on every rank
    shards = [as_sharded(w, mesh, copy=True) for w in wholes]  # this rank's rows, as DTensors
    sizes = tuple(torch.Size(s) for s in shapes)
    owner = owners(tuple(float(newton_schulz_cost(s)) for s in sizes), world)
    ex = exchange(sizes, owner, world)  # the plan on_owners follows for these matrices
    mine = ex.owned[rank]
    cols = [s[1] for s in shapes]
    rows = layout(sizes, world).rows  # [rank][matrix] -> (first row, row count)

    def gather_all() -> list[torch.Tensor]:  # scheme A: every whole matrix on every rank
        return gather_leaves([s.to(torch.bfloat16) for s in shards], mesh)

    def to_owners() -> list[torch.Tensor]:  # scheme B, 1: the rows of each matrix to its owner
        return ex.to_owners([s.to_local().to(torch.bfloat16) for s in shards], rank, group)

    whole_bf16 = [w.bfloat16() for w in wholes]
    owned_bf16 = [whole_bf16[i] for i in mine]
    done = _orthogonalize(owned_bf16)

    def back() -> list[torch.Tensor]:  # scheme B, 2: the results' rows back
        return ex.back(done, rank, group, whole_bf16[0])

    def scheme_a() -> list[torch.Tensor]:  # each rank keeps its rows of every result
        return [as_sharded(o, mesh, copy=False) for o in _orthogonalize(gather_all())]

    def scheme_b() -> list[torch.Tensor]:  # what optim.muon's orthogonalize does
        return on_owners(_orthogonalize, shards, cost=newton_schulz_cost, dtype=torch.bfloat16)

    a, b = scheme_a(), scheme_b()
    same = all(torch.equal(x.to_local(), y.to_local()) for x, y in zip(a, b))
    parts = {
        "A: gather every whole matrix": gather_all,
        "A: Newton–Schulz, every matrix": lambda: _orthogonalize(whole_bf16),
        "B: rows to their owners": to_owners,
        "B: Newton–Schulz, owned matrices": lambda: _orthogonalize(owned_bf16),
        "B: results' rows back": back,
        "A: total": scheme_a,
        "B: total (on_owners)": scheme_b,
    }
    # the recipe's muon step (muon_adamw) on this rank's half of a batch, per strategy
    batch = {k: v[: max(1, len(v) // world)] for k, v in first_batches(cfg, 1)[0].items()}
    for strategy in ("ddp", "zero2", "fsdp"):
        c = dataclasses.replace(cfg, optimizer="muon", shard=strategy)
        _, _, step, state = recipe_state(c)
        box = [shard_state(state, strategy)]

        def run(step=step, box=box) -> None:
            box[0], metrics = step(box[0], batch)
            float(metrics["loss"])

        parts[f"muon_adamw step, {strategy}"] = run
    names = list(parts)
    for f in parts.values():  # warm-up
        dist.barrier()
        f()
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for r in range(n_rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:  # the same order on all ranks
            dist.barrier()
            w, c = time.perf_counter(), time.process_time()
            parts[k]()
            cpu[k].append(time.process_time() - c)
            wall[k].append(time.perf_counter() - w)
    seg = max(sum(rows[r][i][1] * cols[i] for i in range(len(shapes))) for r in range(world))
    theirs = [i for i in range(len(shapes)) if owner[i] != rank]  # bytes from other ranks only
    received = {
        "A": (world - 1) * seg * 2,  # the padded flat all-gather, bfloat16
        "B1": sum(rows[d][i][1] * cols[i] for i in mine for d in range(world) if d != rank) * 2,
        "B2": sum(rows[rank][i][1] * cols[i] for i in theirs) * 2,
    }
    return {
        "wall": {k: statistics.median(v) for k, v in wall.items()},
        "cpu": {k: statistics.median(v) for k, v in cpu.items()},
        "received": received,
        "same": same,
        "shapes": shapes,
        "owned": [shapes[i] for i in mine],
        "total_bytes": sum(math.prod(s) for s in shapes) * 2,
    }


def sharded_section(quick: bool, n_rounds: int) -> str:
    from ftrain.distributed import run_distributed

    load = os.getloadavg()[0]
    res = run_distributed(sharded_muon, 2, quick, n_rounds, timeout=600)
    load = (load, os.getloadavg()[0])
    r0 = res[0]
    wall, cpu = (
        {k: max(r[kind][k] for r in res) for k in r0[kind]} for kind in ("wall", "cpu")
    )  # the slower rank: a step waits for it
    rows = [f"| {k} | {wall[k] * 1e3:.2f} | {cpu[k] * 1e3:.2f} |" for k in wall]
    recv = [r["received"] for r in res]
    a_bytes = max(r["A"] for r in recv)
    b_bytes = max(r["B1"] + r["B2"] for r in recv)
    a_tot, b_tot = wall["A: total"], wall["B: total (on_owners)"]
    cheaper = "B (whole matrices to ranks)" if b_tot < a_tot else "A (gather on every rank)"
    mib = 1 << 20
    shapes = ", ".join(f"{a}x{b}" for a, b in sorted(set(r0["shapes"])))
    ns_all = wall["A: Newton–Schulz, every matrix"]
    ns_half = wall["B: Newton–Schulz, owned matrices"]
    gather_a = wall["A: gather every whole matrix"]
    gather_b = wall["B: rows to their owners"] + wall["B: results' rows back"]
    rows_per_rank = max(1, base_cfg(quick).batch_size // 2)
    step_note = ", ".join(
        f"{s} {wall[f'muon_adamw step, {s}'] * 1e3:.0f} ms" for s in ("ddp", "zero2", "fsdp")
    )
    return f"""`python benchmarks/optimizers.py` on {machine()}; 2 gloo processes, one
torch thread each (the 2 cores). Load average {load[0]:.1f} at the start and {load[1]:.1f} at the end.

The orthogonalization needs each whole matrix; under zero2 and fsdp each rank holds a block of
rows of every update. **A**: one flat all-gather of every hidden matrix's rows (bfloat16), every
rank orthogonalizes all of them and keeps its rows. **B** (what `ftrain.optim.muon` does, through
`ftrain.distributed.data_parallel.owners.on_owners`): each matrix has an owner rank (balanced by Newton–Schulz
cost), an all-to-all sends each matrix's rows to its owner, the owner orthogonalizes its matrices
(batched by shape), a second all-to-all sends the rows back. Measured on
the {len(r0["shapes"])} hidden matrices of the recipe's GPT ({shapes};
{r0["total_bytes"] / mib:.2f} MiB in bfloat16), random updates held as Shard(0) DTensors; B's
result equals A's bit for bit: **{r0["same"]}**. Medians of {n_rounds} rounds (every part once per
round, rotating order, a barrier before each), the slower rank's; CPU time beside (a rank waiting
in a collective sleeps).

| part | wall ms | CPU ms |
| --- | ---: | ---: |
{chr(10).join(rows)}

Bytes each rank receives per step: A {a_bytes / mib:.2f} MiB (one all-gather), B
{b_bytes / mib:.2f} MiB (two all-to-alls). With 2 ranks the bytes are the same
((W-1)/W of the matrices for A, 2(W-1)/W² for B), so B saves Newton–Schulz time
({ns_all * 1e3:.2f} -> {ns_half * 1e3:.2f} ms), and its two collectives together take
{gather_b * 1e3:.2f} ms against A's one {gather_a * 1e3:.2f} ms. Cheaper here: **{cheaper}**,
A {a_tot * 1e3:.2f} ms against B {b_tot * 1e3:.2f} ms per step, next to a whole muon_adamw step
({rows_per_rank} rows per rank; zero2 and fsdp orthogonalize by B) of {step_note}. With W ranks, A's Newton–Schulz work per rank stays
that of every matrix and its bytes per rank approach all of them, while B's both fall as 1/W. B
works with `ft.shard`'s row layout as it is: the momentum stays in rows, only the update's rows
travel.
"""


# -- main ------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few rounds, no write")
    parser.add_argument("--only", choices=["memory", "speed", "budget", "sharded"])
    parser.add_argument("--rounds", type=int, default=15, help="rounds for the step (default 15)")
    parser.add_argument("--budget", type=float, default=None, help="CPU seconds per run (60)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    quick = args.quick
    n_rounds = 3 if quick else args.rounds
    budget = args.budget or (3.0 if quick else BUDGET_S)
    parts = [args.only] if args.only else ["memory", "speed", "budget", "sharded"]
    sections = {}
    t0 = time.perf_counter()
    print(machine(), f"load {os.getloadavg()[0]:.1f}", flush=True)
    if "memory" in parts:
        sections["Optimizer memory"] = memory_section(quick)
    if "speed" in parts or "budget" in parts:
        load = os.getloadavg()[0]
        t = step_times(quick, n_rounds)
        print({k: round(v["cpu"] * 1e3, 1) for k, v in t.items()}, flush=True)
        if "speed" in parts:
            body = speed_section(quick, n_rounds, t, (load, os.getloadavg()[0]))
            sections["Optimizer step time"] = body
        if "budget" in parts:
            load = os.getloadavg()[0]
            runs = budget_runs(quick, budget, t)
            body = budget_section(quick, budget, runs, (load, os.getloadavg()[0]))
            sections["Optimizer loss at equal CPU time"] = body
    if "sharded" in parts:
        body = sharded_section(quick, 5 if quick else 30)
        sections["Sharded Muon"] = body
    for title, body in sections.items():
        print(f"## {title}\n\n{body}", flush=True)
        if not quick:
            write_section(title, body)
    print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
