"""Compile time against micro-batches: the first call of ``ft.compile(ft.accumulate(step, K))``.

    python benchmarks/compile_time.py                   # ~15 min on a 2-core CPU; writes RESULTS.md
    python benchmarks/compile_time.py --before /tmp/old # and the ftrain tree there, side by side
    python benchmarks/compile_time.py --quick           # K = 1 and 2, nothing written

What a user's first run meets: every measurement is a fresh Python process with an empty
``TORCHINDUCTOR_CACHE_DIR`` and inductor's FX-graph and AOT-autograd caches off
(``TORCHINDUCTOR_FX_GRAPH_CACHE=0``, ``TORCHINDUCTOR_AUTOGRAD_CACHE=0``): a warm on-disk cache
would hide the compile. In that process, a small GPT (d 64, 2 blocks, seq 64, batch 16, AdamW)
takes one step of ``ft.compile(step)`` (K = 1) or ``ft.compile(ft.accumulate(step, K))``; that
first call is the compile (plus one step), counted in CPU seconds of the process and of the C++
compiler it runs (one inductor compile thread, so the compiler runs in children the process
waits for) and in wall seconds. CPU seconds are what the target is judged on: on a machine shared
with other work, waiting for a core inflates wall time, not CPU time. Beside it, the median CPU
time of a step after it (one torch thread), compiled and eager (the same step without
``ft.compile``), in the same process.

``--before DIR`` runs the same child processes with another ftrain tree first on ``PYTHONPATH``
(e.g. ``git archive e06890a ftrain | tar -x -C /tmp/old``), interleaved with this one K by K, so
a change in machine load hits both alike. Target: K = 4 and K = 8 within 1.3x of K = 1.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECTION = "Compile time and micro-batches"
ROOT = Path(__file__).resolve().parent.parent  # this ftrain tree
D_MODEL, N_LAYER, SEQ, BATCH = 64, 2, 64, 16


def cpu_seconds() -> float:
    """CPU seconds of this process and of the children it waited for (the C++ compiler)."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def setup(k: int):
    """``(eager step, state, batch)``: the GPT's AdamW step, split into ``k`` micro-batches."""
    import torch

    import ftrain as ft
    from ftrain.models import GPT, GPTConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, seq_len=SEQ, d_model=D_MODEL, n_layer=N_LAYER, n_head=4))
    opt = ft.optim.adamw(1e-3, weight_decay=0.01)

    def loss_fn(params, batch):
        logits = ft.apply(model, params, batch["input"])  # (B, T, V)
        return ft.losses.cross_entropy(logits, batch["target"])

    eager = ft.train_step(loss_fn, opt)
    if k > 1:
        eager = ft.accumulate(eager, k)
    state = ft.TrainState.create(ft.params_of(model), opt)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 257, (BATCH, SEQ + 1), generator=g)
    return eager, state, {"input": x[:, :-1], "target": x[:, 1:]}


def child(k: int, steps: int) -> dict:
    """One cold measurement in this (fresh) process: the first call, then the step times."""
    import statistics

    import ftrain as ft

    eager, state, batch = setup(k)
    compiled = ft.compile(eager)
    wall, cpu = time.perf_counter(), cpu_seconds()
    s, m = compiled(state, batch)
    float(m["loss"])  # the first call: compile + one step
    first = {"first_s": time.perf_counter() - wall, "first_cpu_s": cpu_seconds() - cpu}

    def per_step(step) -> float:
        """Median CPU ms of a step (one thread: waiting for a core does not count)."""
        s, times = state, []
        for _ in range(steps):
            t = time.process_time()
            s, m = step(s, batch)
            float(m["loss"])
            times.append(time.process_time() - t)
        return statistics.median(times[1:]) * 1e3

    return {"k": k, **first, "compiled_ms": per_step(compiled), "eager_ms": per_step(eager)}


def measure(tree: Path, k: int, steps: int) -> dict:
    """:func:`child` in a fresh process, cold caches, ``tree`` first on the path."""
    with tempfile.TemporaryDirectory(prefix="inductor-cold-") as cache:
        env = {
            **os.environ,
            "PYTHONPATH": str(tree),
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
            "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
            "TORCHINDUCTOR_COMPILE_THREADS": "1",  # C++ compiles in children this process waits for
        }
        cmd = [sys.executable, __file__, "--child", str(k), "--steps", str(steps)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"K={k} with {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def steady(k: int, n_rounds: int) -> None:
    """Step time in one process: eager, the old whole-graph compile (k micro-batches unrolled
    into one graph; forced here by a ``wrap`` hook inside compile, which keeps the step whole)
    and the looped one (one micro-batch graph, called k times, and the update's)."""
    from _common import machine, rounds, write_section

    import ftrain as ft

    eager, state, batch = setup(k)
    whole = ft.compile(ft.wrap(eager, lambda fn: lambda s, b: fn(s, b), name="whole"))
    fns = {"eager": eager, "whole graph (before)": whole, "looped (after)": ft.compile(eager)}
    times = rounds({name: lambda f=f: f(state, batch) for name, f in fns.items()}, n_rounds)
    base = times["whole graph (before)"]["cpu"]
    rows = [
        f"| {name} | {t['cpu'] * 1e3:.1f} | {t['wall'] * 1e3:.1f} | {t['cpu'] / base:.2f} |"
        for name, t in times.items()
    ]
    body = f"""`python benchmarks/compile_time.py --steady {k}` on {machine()}; load average
(1 min) {os.getloadavg()[0]:.1f} at the end.

The same GPT, K = {k} micro-batches, in one process (warm, one torch thread): median ms per step
over {n_rounds} rounds, the order rotating each round. *whole graph*: the compile before the
loop, K micro-batches unrolled into one graph (forced here by an `ft.wrap` inside `ft.compile`);
*looped*: one micro-batch graph called K times, then the update's graph.

| step | CPU ms | wall ms | CPU / whole graph |
| --- | ---: | ---: | ---: |
{chr(10).join(rows)}
"""
    write_section(SECTION + ": step time", body)
    print(body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=12, help="steps timed per side after the first")
    p.add_argument("--before", type=Path, help="another ftrain tree to measure beside this one")
    p.add_argument("--ks", default="1,4,8", help="micro-batch counts (comma-separated)")
    p.add_argument("--quick", action="store_true", help="K = 1 and 2, 4 steps, nothing written")
    p.add_argument("--steady", type=int, help="step time at this K, in one process, old vs new")
    p.add_argument("--rounds", type=int, default=20, help="rounds of --steady")
    args = p.parse_args()
    if args.steady is not None:
        return steady(args.steady, args.rounds)
    if args.child is not None:
        print(json.dumps(child(args.child, args.steps)))
        return
    ks = [1, 2] if args.quick else [int(k) for k in args.ks.split(",")]
    steps = 4 if args.quick else args.steps
    trees = {"after": ROOT} if args.before is None else {"before": args.before, "after": ROOT}
    load = [os.getloadavg()[0]]
    results: dict[str, dict[int, dict]] = {name: {} for name in trees}
    for k in ks:  # interleaved: before and after back to back for each K
        for name, tree in trees.items():
            r = measure(tree, k, steps)
            results[name][k] = r
            load.append(os.getloadavg()[0])
            print(f"{name:6s} K={k}: first call {r['first_cpu_s']:6.1f} CPU s ({r['first_s']:6.1f} "
                  f"wall), step CPU ms compiled {r['compiled_ms']:6.1f}, eager {r['eager_ms']:6.1f}",
                  flush=True)  # fmt: skip
    if args.quick:
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _common import machine, write_section

    rows = []
    for name, by_k in results.items():
        base = by_k[ks[0]]
        for k, r in by_k.items():
            rows.append(
                f"| {name} | {k} | {r['first_cpu_s']:.1f} | **{r['first_cpu_s'] / base['first_cpu_s']:.2f}** "
                f"| {r['first_s']:.1f} | {r['first_s'] / base['first_s']:.2f} | "
                f"{r['compiled_ms']:.1f} | {r['eager_ms']:.1f} |"
            )
    body = f"""`python benchmarks/compile_time.py{" --before DIR" if args.before else ""}` on
{machine()}; load average (1 min) {min(load):.1f}-{max(load):.1f} during the run (2 cores shared with
other work: wall seconds are inflated by waiting for a core, CPU seconds much less so).

GPT d {D_MODEL}, {N_LAYER} blocks, seq {SEQ}, batch {BATCH} (split into K micro-batches), AdamW.
Each row is a fresh process with an empty inductor cache directory, the FX-graph and AOT caches
off (a user's first run) and one inductor compile thread (the C++ compiler runs in children the
process waits for, so their CPU time is counted). *first call*: the first call of
`ft.compile(ft.accumulate(step, K))` (K = 1: `ft.compile(step)`), compile included, in CPU seconds
(this process and the compiler's; the target is judged on these) and wall seconds; *ratio*:
against K = 1 of the same code. Step: median CPU ms per step after it (one torch thread),
compiled and eager (the same step without `ft.compile`). Target: K = 4 and 8 within 1.3x of
K = 1.

| code | K | first call, CPU s | ratio to K = 1 | first call, wall s | wall ratio | compiled step, ms | eager step, ms |
| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
{chr(10).join(rows)}
"""
    if args.before is not None:
        ratios = {
            name: ", ".join(
                f"{by_k[k]['first_cpu_s'] / by_k[ks[0]]['first_cpu_s']:.2f}x (K = {k})"
                for k in ks[1:]
            )
            for name, by_k in results.items()
        }
        body += (
            f"\n*before*: the ftrain tree at `{args.before}`; *after*: this one. First call "
            f"against K = {ks[0]}, CPU seconds: {ratios['after']} after, {ratios['before']} "
            "before. The step times here are a few steps each on a loaded machine (the eager "
            "step, the same code on both sides, moves by up to a third between rows); the next "
            "section compares the compiled steps interleaved in one process.\n"
        )
    write_section(SECTION, body)
    print(body)


if __name__ == "__main__":
    main()
