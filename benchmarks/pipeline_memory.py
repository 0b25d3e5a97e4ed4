"""``ft.memory`` of a pipelined step: each rank's predicted peak against its measured one, per
schedule, at pp = 2 and 4, dp 2 x pp 2, and against one process (pp = 1).

    python benchmarks/pipeline_memory.py           # (about two minutes on 2 cores); writes RESULTS.md
    python benchmarks/pipeline_memory.py --quick   # pp = 2 at a tiny size, nothing written

Model: ftrain's GPT (d=256, 8 blocks, seq 128, tied head), AdamW, 4 rows of 128 tokens per
micro-batch, ``m = 2 p`` micro-batches: one micro-batch's activations through the whole model
weigh about as much as its params and optimizer state, so the schedules' peaks differ. Each rank
plans its own step (``ft.memory``: its stages' params, gradients and optimizer state, and the
activations its schedule keeps), then takes the real step once, whose peak
``ftrain.testing.peak_bytes`` measures: the live bytes of every storage, state and batch
included, in the pipeline's first step (when torch's stages make the receive buffers they keep).
pp = 1 is one process with the whole model, the same micro-batches under ``ft.accumulate``.
Writes the subsection "ft.memory of a pipelined step" of RESULTS.md's "Pipeline parallel".
"""

from __future__ import annotations

import argparse
import os

import torch

import ftrain as ft
from ftrain.distributed import run_distributed
from ftrain.distributed.pipeline.runner import refusal
from ftrain.memory.pipeline_plan import PLANNED
from ftrain.models import GPT, GPTConfig
from ftrain.testing import peak_bytes

SECTION, TITLE = "Pipeline parallel", "ft.memory of a pipelined step"
SCHEDULES = tuple(s for s in PLANNED if refusal(s, "gloo") is None)  # this torch's, over gloo


def _setup(cfg: GPTConfig, rows: int):
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=g)

    def loss_fn(params, b):
        return ft.losses.cross_entropy(ft.apply(model, params, b["input"]), b["target"])

    return model, {"input": x, "target": torch.roll(x, -1, dims=1)}, loss_fn


def _planned_and_measured(step, state, batch) -> dict:
    report = ft.memory(step, state, batch)  # planned first: the real step comes after
    return {"predicted": report.peak, "measured": peak_bytes(step, state, batch),
            "alive": report.in_flight}  # fmt: skip


def _on_rank(cfg: GPTConfig, p: int, m: int, rows: int, shards: tuple[str, ...]) -> dict:
    """Every planned schedule on this rank (pp = ``p``), or with ``shards`` dp 2 x pp 2 1F1B
    under each ft.shard strategy; a fresh pipeline for each."""
    torch.set_num_threads(1)
    model, batch, loss_fn = _setup(cfg, m * rows)
    mesh = ft.distributed.pipeline.pp_mesh(pp=p)
    out = {}
    for name in shards or SCHEDULES:
        opt = ft.optim.adamw(1e-3)
        pp = ft.pipeline(model, mesh, schedule="1f1b" if shards else name, microbatches=m)
        step = pp(ft.train_step(loss_fn, opt))
        state = pp.shard_state(ft.TrainState.create(ft.params_of(model), opt))
        mine = batch
        if shards:
            dp, me = mesh["dp"].size(), mesh["dp"].get_local_rank()
            mine = {k: v.chunk(dp)[me] for k, v in batch.items()}
            state = ft.shard_state(state, name, mesh=mesh["dp"])
            step = ft.shard(step, name, mesh=mesh["dp"])
        out[name] = _planned_and_measured(step, state, mine)
    return out


def _one_process(cfg: GPTConfig, m: int, rows: int) -> dict:
    model, batch, loss_fn = _setup(cfg, m * rows)
    opt = ft.optim.adamw(1e-3)
    step = ft.accumulate(ft.train_step(loss_fn, opt), m)
    return _planned_and_measured(step, ft.TrainState.create(ft.params_of(model), opt), batch)


def _cell(r: dict) -> str:
    return f"{r['predicted'] / 2**20:.1f} / {r['measured'] / 2**20:.1f} ({r['predicted'] / r['measured'] - 1:+.1%})"


def table(results: list[dict], one: dict, names) -> list[str]:
    ranks = range(len(results))
    lines = [
        "| | " + " | ".join(f"rank {r}: predicted / measured MiB" for r in ranks)
        + " | micro-batches alive per rank | measured peak per rank / pp=1 |",
        "| --- |" + " ---: |" * len(results) + " --- | --- |",
    ]  # fmt: skip
    for name in names:
        row = [results[r][name] for r in ranks]
        alive = " / ".join(str(x["alive"]) for x in row)
        ratio = " / ".join(f"{x['measured'] / one['measured']:.2f}" for x in row)
        lines.append(f"| {name} | " + " | ".join(map(_cell, row)) + f" | {alive} | {ratio} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, pp = 2; write nothing")
    args = ap.parse_args()
    if args.quick:
        cfg, sizes, rows = GPTConfig(seq_len=16, d_model=32, n_layer=4, n_head=2), [2], 2
    else:
        cfg = GPTConfig(seq_len=128, d_model=256, n_layer=8, n_head=8, matmul="torch")
        sizes, rows = [2, 4], 4
    load = os.getloadavg()[0]
    from _common import machine

    body = []
    for p in sizes:
        m = 2 * p
        one = _one_process(cfg, m, rows)
        results = run_distributed(_on_rank, p, cfg, p, m, rows, (), timeout=1800)
        body += [f"pp = {p}, m = {m} micro-batches of {rows} rows (pp = 1: predicted / measured "
                 f"{_cell(one)} MiB):", "", *table(results, one, SCHEDULES), ""]  # fmt: skip
    if not args.quick:
        shards = ("ddp", "zero1", "zero2")
        one = _one_process(cfg, 4, rows // 2)  # one dp replica's share: half the rows
        results = run_distributed(_on_rank, 4, cfg, 2, 4, rows, shards, timeout=1800)
        body += [f"dp 2 x pp 2 (4 processes), 1F1B, m = 4 micro-batches of {rows // 2} rows per "
                 f"replica (pp = 1: {_cell(one)} MiB):", "", *table(results, one, shards), ""]  # fmt: skip
    setup = (
        f"`python benchmarks/pipeline_memory.py` on {machine()}; gloo, 1 torch thread per "
        f"process, load average {load:.1f} at the start. GPT d={cfg.d_model}, {cfg.n_layer} "
        f"blocks, seq {cfg.seq_len}, tied head, AdamW. Each rank's `ft.memory(step, state, "
        "batch).peak` (planned on fake tensors, its schedule's actions run locally: nothing "
        "sent) against the peak of live bytes of its real step (`ftrain.testing.peak_bytes`, "
        "the pipeline's first step, in which torch's stages make the receive buffers they "
        "keep)."
    )
    text = "\n".join([setup, "", *body])
    print(text, flush=True)
    if not args.quick:
        from _common import write_subsection

        write_subsection(SECTION, TITLE, text)


if __name__ == "__main__":
    main()
