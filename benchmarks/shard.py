"""Shard benchmark: per-rank memory by strategy, and step time relative to ddp, on 2 CPU
processes (gloo), beside torch's own DistributedDataParallel and FSDP2 (``fully_shard``), and
tensor parallelism (``ft.tensor_parallel`` with tp = 2: each rank holds half of every block matrix).

    python benchmarks/shard.py            # about 3 minutes on a 2-core CPU; writes RESULTS.md
    python benchmarks/shard.py --quick    # a smoke run at a tiny size, nothing written
    python benchmarks/shard.py --mesh2d   # 4 processes, 2 (dp) x 2 (tp): each strategy over dp
    python benchmarks/shard.py --prefetch # fsdp with and without prefetch (about 2 minutes)
    python benchmarks/shard.py --buckets  # ddp/zero2 reducing in backward or after it (1 minute)

Model: ftrain's GPT (d=128, 4 blocks, seq 128), 8 rows per rank (16 in all), AdamW. Each of the
two processes runs with one torch thread (two processes share the two cores).

Memory, per rank, in bytes of tensors (what the strategy decides; the allocator and the torch
runtime are the same for all): the params and optimizer state the rank keeps between steps
(``local_bytes``: a DTensor counts its shard), the gradients it holds after the reduce phase, and
for fsdp the most bytes of gathered whole parameters alive at once during a step
(``track_gathered``). The torch rows count the same things from their modules and optimizers.

Time: every variant runs once per round, rounds rotate the order, each rank times its own steps
(ranks move in lockstep through their collectives), and a ratio is a ratio of rank 0's medians.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ftrain as ft
from ftrain.distributed import STRATEGIES, local_bytes, run_distributed, shard_state, track_gathered
from ftrain.distributed.data_parallel.buckets import buckets
from ftrain.models import GPT, GPTConfig
from ftrain.transforms import shard

SECTION = "Shard"
SECTION_2D = "Shard on a 2-D mesh"
SECTION_PREFETCH = "Shard: fsdp prefetch"
SECTION_BUCKETS = "Shard: ddp and zero2 reducing during backward"
BUCKETS = (None, 25.0, 0.5)  # bucket_mb: after backward; the default (one bucket here); ~9


def _bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        total += t.numel() * t.element_size()
    return total


def _rank_setup(cfg: GPTConfig, rows: int):
    """This process's model template (the same on every rank), its own batch and the loss."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    template = GPT(cfg)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=g)
    batch = {"input": x, "target": torch.roll(x, -1, dims=1)}

    def loss_fn(params, b):
        return ft.losses.cross_entropy(ft.apply(template, params, b["input"]), b["target"])

    return template, batch, loss_fn


def _ftrain_run(template, batch, loss_fn, name: str, strategy: str, **shard_kw):
    """ftrain's donated AdamW step (``name`` ending in "checkpoint": checkpointed) sharded by
    ``strategy``: a function running one step (waiting for it), its state box, and the most
    whole params its second step held gathered at once (``track_gathered``)."""
    opt = ft.optim.adamw(1e-3)
    step = ft.train_step(loss_fn, opt, donate=True)
    if name.endswith("checkpoint"):
        step = ft.checkpoint(step)
    step = shard(step, strategy, **shard_kw)
    box = [shard_state(ft.TrainState.create(ft.params_of(template), opt), strategy)]

    def run(step=step, box=box):
        box[0], metrics = step(box[0], batch)
        float(metrics["loss"])  # wait for the step

    run()
    with track_gathered() as t:
        run()
    return run, box, t.peak


def _on_rank(cfg: GPTConfig, rows: int, rounds: int) -> dict:
    """Runs on each of the two processes: every variant, interleaved."""
    template, batch, loss_fn = _rank_setup(cfg, rows)
    rank, x = dist.get_rank(), batch["input"]
    runs, memory = {}, {}
    for name in [*STRATEGIES, "fsdp+checkpoint"]:
        strategy = name.split("+")[0]
        run, box, gathered = _ftrain_run(template, batch, loss_fn, name, strategy)
        state = box[0]
        whole_grads = strategy in ("ddp", "zero1")
        memory[name] = {
            "params": local_bytes(state.params),
            "opt": local_bytes(state.opt_state),
            "grads": local_bytes(unsharded(state.params)) if whole_grads else None,
            "peak": gathered if strategy == "fsdp" else None,
        }
        if memory[name]["grads"] is None:  # reduce-scattered: one shard of each gradient
            memory[name]["grads"] = _shard_bytes(state.params, rank)
        runs[name] = run

    # tensor parallel, tp = 2 (dp = 1): both ranks take the same whole batch (the two ranks' rows,
    # so a step covers as many tokens as ddp's), each holding half of every block matrix
    mesh = ft.distributed.tp_mesh(2)
    tp = ft.tensor_parallel(template, ft.distributed.gpt_plan(), mesh)
    opt = ft.optim.adamw(1e-3)
    tp_step = tp(ft.train_step(loss_fn, opt, donate=True))
    tp_box = [tp.shard_state(ft.TrainState.create(ft.params_of(template), opt))]
    rows_of = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(rows_of, x)
    whole_x = torch.cat(rows_of)
    whole_batch = {"input": whole_x, "target": torch.roll(whole_x, -1, dims=1)}

    def run_tp(step=tp_step, box=tp_box):
        box[0], metrics = step(box[0], whole_batch)
        float(metrics["loss"])

    run_tp()
    runs["tp=2"] = run_tp
    state = tp_box[0]
    memory["tp=2"] = {
        "params": local_bytes(state.params),
        "opt": local_bytes(state.opt_state),
        "grads": local_bytes(state.params),  # a piece's gradient is a piece; whole params' whole
        "peak": None,
    }
    split = [t for t in ft.tree.leaves(state.params) if _is_split(t)]
    memory["tp blocks"] = {
        "split local": sum(_bytes([t]) for t in split),
        "split whole": sum(t.numel() * t.element_size() for t in split),
    }

    # torch's own: DDP and FSDP2, with torch.optim.AdamW (foreach)
    from torch.nn.parallel import DistributedDataParallel

    ddp_model = DistributedDataParallel(copy.deepcopy(template))
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3, foreach=True)
    runs["torch DDP"] = _torch_run(ddp_model, ddp_opt, batch, cfg)
    runs["torch DDP"]()
    memory["torch DDP"] = {
        "params": _bytes(ddp_model.parameters()),
        "opt": _bytes(v for s in ddp_opt.state.values() for v in s.values()),
        "grads": _bytes(p.grad for p in ddp_model.parameters()),
        "peak": None,
    }
    try:
        from torch.distributed.fsdp import fully_shard

        fsdp_model = copy.deepcopy(template)
        for block in fsdp_model.blocks:
            fully_shard(block)
        fully_shard(fsdp_model)
        fsdp_opt = torch.optim.AdamW(fsdp_model.parameters(), lr=1e-3, foreach=True)
        runs["torch FSDP2"] = _torch_run(fsdp_model, fsdp_opt, batch, cfg)
        runs["torch FSDP2"]()
        memory["torch FSDP2"] = {
            "params": _bytes(fsdp_model.parameters()),
            "opt": _bytes(v for s in fsdp_opt.state.values() for v in s.values()),
            "grads": _bytes(p.grad for p in fsdp_model.parameters()),
            "peak": None,
        }
    except Exception as e:  # noqa: BLE001 - report what torch could not do here
        memory["torch FSDP2"] = {"error": f"{type(e).__name__}: {e}"[:200]}

    # fsdp's parameter memory as the model deepens: the shard grows, the gathered part does not
    sweep = []
    for n_layer in (2, 8, 16):
        deep = GPT(GPTConfig(**{**cfg.__dict__, "n_layer": n_layer}))

        def deep_loss(params, b, deep=deep):
            return ft.losses.cross_entropy(ft.apply(deep, params, b["input"]), b["target"])

        opt = ft.optim.adamw(1e-3)
        step = shard(ft.train_step(deep_loss, opt, donate=True), "fsdp")
        state = shard_state(ft.TrainState.create(ft.params_of(deep), opt), "fsdp")
        state, _ = step(state, batch)
        with track_gathered() as t:
            state, _ = step(state, batch)
        whole = sum(p.numel() * p.element_size() for p in deep.parameters())
        sweep.append((n_layer, whole, local_bytes(state.params), t.peak))

    return {"sweep": sweep, "memory": memory, **_time_rounds(runs, rounds)}


def _time_rounds(runs: dict, rounds: int) -> dict:
    """Median wall and CPU seconds of each run on this rank: every run once per round, the order
    rotating, a barrier before each (ranks move in lockstep through their collectives)."""
    wall = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    names = list(runs)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for k in order:
            dist.barrier()
            w, c = time.perf_counter(), time.process_time()
            runs[k]()
            wall[k].append(time.perf_counter() - w)
            cpu[k].append(time.process_time() - c)
    return {
        "wall": {k: statistics.median(v) for k, v in wall.items()},
        "cpu": {k: statistics.median(v) for k, v in cpu.items()},
    }


def _on_rank_prefetch(cfg: GPTConfig, rows: int, rounds: int) -> dict:
    """Runs on each of the two processes: fsdp and fsdp+checkpoint, each with prefetch on and
    off, interleaved; the plain PyTorch way (FSDP2, which prefetches) beside them."""
    template, batch, loss_fn = _rank_setup(cfg, rows)
    runs, peaks = {}, {}
    for name in ("fsdp", "fsdp+checkpoint"):
        for prefetch in (False, True):
            run, _, gathered = _ftrain_run(
                template, batch, loss_fn, name, "fsdp", prefetch=prefetch
            )
            key = f"{name}, prefetch={prefetch}"
            runs[key], peaks[key] = run, gathered
    try:
        from torch.distributed.fsdp import fully_shard

        model = copy.deepcopy(template)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        runs["torch FSDP2"] = _torch_run(model, torch.optim.AdamW(model.parameters()), batch, cfg)
        runs["torch FSDP2"]()
    except Exception:  # noqa: BLE001 - the ftrain rows stand on their own
        pass
    return {"peaks": peaks, **_time_rounds(runs, rounds)}


def _on_rank_buckets(cfg: GPTConfig, rows: int, rounds: int) -> dict:
    """Runs on each of the two processes: ddp and zero2 with the gradients reduced after backward
    (bucket_mb=None) and in buckets during it, interleaved; torch DDP (buckets too) beside."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    template, batch, loss_fn = _rank_setup(cfg, rows)
    runs = {}
    for strategy in ("ddp", "zero2"):
        for mb in BUCKETS:
            run, _, _ = _ftrain_run(template, batch, loss_fn, strategy, strategy, bucket_mb=mb)
            runs[f"{strategy}, bucket_mb={mb}"] = run
    for mb in BUCKETS[1:]:
        model = DDP(copy.deepcopy(template), bucket_cap_mb=mb)
        runs[f"torch DDP, bucket_cap_mb={mb}"] = _torch_run(
            model, torch.optim.AdamW(model.parameters()), batch, cfg
        )
        runs[f"torch DDP, bucket_cap_mb={mb}"]()
    return _time_rounds(runs, rounds)


def report_buckets(results: list[dict], setup: str) -> str:
    wall, cpu = results[0]["wall"], results[0]["cpu"]
    lines = [
        setup,
        "",
        "| variant | step ms (wall) | / after backward | step ms (CPU) | / after backward |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in wall:  # torch DDP against ftrain's ddp reducing after backward
        base = ("ddp" if name.startswith("torch") else name.split(",")[0]) + ", bucket_mb=None"
        lines.append(
            f"| {name} | {wall[name] * 1e3:.0f} | {wall[name] / wall[base]:.2f} "
            f"| {cpu[name] * 1e3:.0f} | {cpu[name] / cpu[base]:.2f} |"
        )
    return "\n".join(lines)


def _main_buckets(cfg: GPTConfig, rows: int, rounds: int, quick: bool, load: float) -> None:
    results = run_distributed(_on_rank_buckets, 2, cfg, rows, rounds, timeout=3600)
    from _common import machine

    params = list(GPT(cfg).parameters())
    whole = sum(p.numel() for p in params) * 4
    cut = {mb: len(buckets(params, int(mb * (1 << 20)), False)) for mb in BUCKETS[1:]}
    setup = (
        f"`python benchmarks/shard.py --buckets` on {machine()}; 2 processes (gloo), 1 torch "
        f"thread each. GPT d={cfg.d_model}, {cfg.n_layer} blocks, seq {cfg.seq_len}, {rows} rows "
        f"per rank, donated AdamW, {whole / (1 << 20):.2f} MiB of gradients; median of {rounds} "
        f"interleaved rounds, rank 0. Load average {load:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end. bucket_mb=None reduces all gradients after "
        "backward (one flat collective); a number reduces them during the last backward in "
        f"buckets of that many MiB, each started async as backward fills it ({cut[0.5]} "
        f"buckets at 0.5), where the gradients fill more than one ({cut[25.0]} at 25, the "
        f"default{': reduced after backward, as with None' if cut[25.0] == 1 else ''}). The "
        "same bits either way. torch DDP's ratio is to ftrain's ddp reducing after backward. On "
        "2 CPU processes gloo's threads share the cores with the backward, so little overlaps, "
        "and the copies into the buckets (a hook per gradient) and the loss sums' own small "
        "all-reduce cost time; on a GPU the buckets' collectives run on NCCL's stream beside "
        "the backward, as torch DDP's do."
    )
    text = report_buckets(results, setup)
    print(text)
    if not quick:
        from _common import write_section

        write_section(SECTION_BUCKETS, text)


def report_prefetch(results: list[dict], setup: str) -> str:
    r0 = results[0]
    wall, cpu, peaks = r0["wall"], r0["cpu"], r0["peaks"]
    lines = [
        setup,
        "",
        "| variant | peak whole params MiB | step ms (wall) | / prefetch off | step ms (CPU) "
        "| / prefetch off |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in wall:
        # each against itself with prefetch off; torch FSDP2 against ftrain's fsdp with it off
        base = name.replace("prefetch=True", "prefetch=False")
        base = base if "prefetch=" in name else "fsdp, prefetch=False"
        peak = f"{peaks[name] / (1 << 20):.2f}" if name in peaks else ""
        lines.append(
            f"| {name} | {peak} | {wall[name] * 1e3:.0f} | {wall[name] / wall[base]:.2f} "
            f"| {cpu[name] * 1e3:.0f} | {cpu[name] / cpu[base]:.2f} |"
        )
    return "\n".join(lines)


def _main_prefetch(cfg: GPTConfig, rows: int, rounds: int, quick: bool, load: float) -> None:
    results = run_distributed(_on_rank_prefetch, 2, cfg, rows, rounds, timeout=3600)
    from _common import machine

    setup = (
        f"`python benchmarks/shard.py --prefetch` on {machine()}; 2 processes (gloo), 1 torch "
        f"thread each. GPT d={cfg.d_model}, {cfg.n_layer} blocks, seq {cfg.seq_len}, {rows} rows "
        f"per rank, AdamW; median of {rounds} interleaved rounds, rank 0. Load average "
        f"{load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end. prefetch=True starts "
        "each block's all-gather one block early and leaves each reduce-scatter in flight during "
        "the next block's backward (async gloo collectives, run by gloo's own threads); the same "
        "bits as prefetch=False. The peak counts the next block's gather buffer. torch FSDP2's "
        "ratio is to ftrain's fsdp with prefetch off."
    )
    text = report_prefetch(results, setup)
    print(text)
    if not quick:
        from _common import write_section

        write_section(SECTION_PREFETCH, text)


MESH_2D = ["ddp", "zero1", "zero2", "fsdp", "fsdp+sp"]


def _on_rank_2d(cfg: GPTConfig, rows: int, rounds: int) -> dict:
    """Runs on each of four processes, a 2 (dp) x 2 (tp) mesh: tensor parallelism over tp and
    each strategy over dp (``fsdp+sp``: with sequence parallelism), interleaved."""
    torch.set_num_threads(1)
    mesh = ft.distributed.tp_mesh(2)
    dp = mesh["dp"]
    torch.manual_seed(0)
    template = GPT(cfg)
    g = torch.Generator().manual_seed(dp.get_local_rank())  # the tp ranks of a group share rows
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=g)
    batch = {"input": x, "target": torch.roll(x, -1, dims=1)}

    def loss_fn(params, b):
        return ft.losses.cross_entropy(ft.apply(template, params, b["input"]), b["target"])

    runs, memory = {}, {}
    for name in MESH_2D:
        strategy = name.split("+")[0]
        opt = ft.optim.adamw(1e-3)
        tp = ft.tensor_parallel(
            template, ft.distributed.gpt_plan(), mesh, sequence_parallel=name.endswith("sp")
        )
        step = ft.shard(tp(ft.train_step(loss_fn, opt, donate=True)), strategy, mesh=dp)
        state = tp.shard_state(ft.TrainState.create(ft.params_of(template), opt))
        box = [ft.shard_state(state, strategy, mesh=dp)]

        def run(step=step, box=box):
            box[0], metrics = step(box[0], batch)
            float(metrics["loss"])

        run()
        memory[name] = {"params": local_bytes(box[0].params), "opt": local_bytes(box[0].opt_state)}
        runs[name] = run
    return {"memory": memory, **_time_rounds(runs, rounds)}


def report_2d(results: list[dict], setup: str, whole: int) -> str:
    r0 = results[0]
    wall, cpu, mib = r0["wall"], r0["cpu"], 1 << 20
    lines = [
        setup,
        "",
        "| over dp | params MiB | optimizer MiB | / ddp (params + optimizer) | step ms (wall) "
        "| / ddp | step ms (CPU) | / ddp |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ddp = r0["memory"]["ddp"]
    for name, m in r0["memory"].items():
        kept = (m["params"] + m["opt"]) / (ddp["params"] + ddp["opt"])
        lines.append(
            f"| {name} | {m['params'] / mib:.2f} | {m['opt'] / mib:.2f} | {kept:.2f} "
            f"| {wall[name] * 1e3:.0f} | {wall[name] / wall['ddp']:.2f} "
            f"| {cpu[name] * 1e3:.0f} | {cpu[name] / cpu['ddp']:.2f} |"
        )
    lines += [
        "",
        f"Whole params {whole / mib:.2f} MiB. Every row is tensor parallel over tp (each rank "
        "holds half of every block matrix); zero1/zero2 split the optimizer state over dp too, "
        "fsdp the params as well, each piece along a dimension tp does not split "
        "(`ftrain.distributed.data_parallel.dp_split`). Four processes share the two cores, so the CPU "
        "column is the one to judge.",
    ]
    return "\n".join(lines)


def _is_split(t) -> bool:
    """Whether ``t`` is a DTensor that some mesh dimension splits (a tensor-parallel piece)."""
    return hasattr(t, "placements") and any(not p.is_replicate() for p in t.placements)


def unsharded(params):
    return params  # ddp/zero1 keep whole params, and so whole gradients of the same size


def _shard_bytes(params, rank) -> int:
    """Bytes of this rank's Shard(0) rows of tensors shaped like ``params``."""
    world = dist.get_world_size()
    total = 0
    for t in ft.tree.leaves(params):
        if hasattr(t, "to_local"):
            t = t.to_local()
            total += t.numel() * t.element_size()
            continue
        n = t.shape[0] if t.dim() else 1
        per = -(-n // world)
        rows = max(0, min(per, n - rank * per))
        total += rows * (t.numel() // max(n, 1)) * t.element_size()
    return total


def _torch_run(model, opt, batch, cfg):
    def run():
        opt.zero_grad(set_to_none=True)
        logits = model(batch["input"])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), batch["target"].reshape(-1))
        loss.backward()
        opt.step()
        float(loss.detach())

    return run


def report(results: list[dict], setup: str) -> str:
    r0 = results[0]
    wall, cpu = r0["wall"], r0["cpu"]
    mib = 1 << 20
    lines = [
        setup,
        "",
        "| variant | params MiB | optimizer MiB | grads MiB | peak whole params MiB | step ms "
        "(wall) | / ddp | step ms (CPU) | / ddp |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, m in r0["memory"].items():
        if name == "tp blocks":
            continue
        if "error" in m:
            lines.append(f"| {name} | not run: {m['error']} | | | | | | | |")
            continue
        peak = f"{m['peak'] / mib:.2f}" if m["peak"] is not None else ""
        lines.append(
            f"| {name} | {m['params'] / mib:.2f} | {m['opt'] / mib:.2f} | {m['grads'] / mib:.2f} "
            f"| {peak} | {wall[name] * 1e3:.0f} | {wall[name] / wall['ddp']:.2f} "
            f"| {cpu[name] * 1e3:.0f} | {cpu[name] / cpu['ddp']:.2f} |"
        )
    tp, ddp = r0["memory"]["tp=2"], r0["memory"]["ddp"]
    blocks = r0["memory"]["tp blocks"]
    lines += [
        "",
        f"tp=2 per rank against ddp: the split matrices (every block's qkv, proj, MLP) "
        f"{blocks['split local'] / mib:.2f} of {blocks['split whole'] / mib:.2f} MiB "
        f"({blocks['split local'] / blocks['split whole']:.2f}); all params "
        f"{tp['params'] / ddp['params']:.2f}, optimizer state {tp['opt'] / ddp['opt']:.2f} "
        "(embeddings, norms and biases of row-parallel layers stay whole on both ranks). "
        "tp=2 runs both ranks' rows on each rank, so its step covers the same tokens as ddp's.",
    ]
    lines += [
        "",
        "fsdp parameter memory per rank as the model deepens (same width): the shard is half the "
        "params, the gathered part stays one block plus the params outside the blocks (and, with "
        "prefetch, the default, the next block's gather buffer).",
        "",
        "| blocks | whole params MiB | shard MiB | peak gathered MiB | shard + peak / whole |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for n_layer, whole, shard_bytes, peak in r0["sweep"]:
        lines.append(
            f"| {n_layer} | {whole / mib:.2f} | {shard_bytes / mib:.2f} | {peak / mib:.2f} "
            f"| {(shard_bytes + peak) / whole:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes; print, write nothing")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument(
        "--mesh2d", action="store_true", help="4 processes, 2 (dp) x 2 (tp): strategies over dp"
    )
    p.add_argument("--prefetch", action="store_true", help="fsdp with and without prefetch")
    p.add_argument("--buckets", action="store_true", help="ddp/zero2 reducing in or after backward")
    args = p.parse_args()
    if args.quick:
        cfg, rows, rounds = GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2), 2, 3
    else:
        cfg, rows, rounds = GPTConfig(seq_len=128, d_model=128, n_layer=4, n_head=4), 8, args.rounds
    load = os.getloadavg()[0]
    if args.mesh2d:
        return _main_2d(cfg, rows, rounds, args.quick, load)
    if args.prefetch:
        return _main_prefetch(cfg, rows, rounds, args.quick, load)
    if args.buckets:
        return _main_buckets(cfg, rows, rounds, args.quick, load)
    results = run_distributed(_on_rank, 2, cfg, rows, rounds, timeout=3600)
    whole = sum(p.numel() for p in GPT(cfg).parameters()) * 4
    block = sum(p.numel() for p in GPT(cfg).blocks[0].parameters()) * 4
    from _common import machine

    setup = (
        f"`python benchmarks/shard.py` on {machine()}; 2 processes (gloo), 1 torch thread each. "
        f"GPT d={cfg.d_model}, {cfg.n_layer} blocks, seq {cfg.seq_len}, {rows} rows per rank, "
        f"AdamW; median of {rounds} interleaved rounds, rank 0. Whole params: "
        f"{whole / (1 << 20):.2f} MiB, one block {block / (1 << 20):.2f} MiB. Load average "
        f"{load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end. Bytes are those of "
        "tensors per rank: params and optimizer state kept between steps, gradients after the "
        "reduce, and (fsdp) the most gathered whole params alive at once. torch DDP averages "
        "per-rank mean losses (not token-exact); ftrain's strategies are token-exact."
    )
    text = report(results, setup)
    print(text)
    if not args.quick:
        from _common import write_section

        write_section(SECTION, text)


def _main_2d(cfg: GPTConfig, rows: int, rounds: int, quick: bool, load: float) -> None:
    results = run_distributed(_on_rank_2d, 4, cfg, rows, rounds, timeout=3600)
    whole = sum(p.numel() for p in GPT(cfg).parameters()) * 4
    from _common import machine

    setup = (
        f"`python benchmarks/shard.py --mesh2d` on {machine()}; 4 processes (gloo) on a 2 (dp) x "
        f"2 (tp) mesh, 1 torch thread each. GPT d={cfg.d_model}, {cfg.n_layer} blocks, seq "
        f"{cfg.seq_len}, {rows} rows per dp group, AdamW; median of {rounds} interleaved rounds, "
        f"rank 0. Load average {load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end. "
        "Bytes of tensors per rank kept between steps."
    )
    text = report_2d(results, setup, whole)
    print(text)
    if not quick:
        from _common import write_section

        write_section(SECTION_2D, text)


if __name__ == "__main__":
    main()
