"""Born sharded: the host memory and the time of creating an fsdp state on 2 processes.

    python benchmarks/born.py            # about a minute on a 2-core CPU; writes RESULTS.md
    python benchmarks/born.py --quick    # a smoke run at a tiny size, nothing written

Each rank (gloo, one torch thread) creates a GPT's fsdp state with AdamW two ways, interleaved:
``ft.distributed.sharded_init`` (built on meta, replayed one parameter at a time, each cut to
this rank's rows) and the plain way (``torch.manual_seed``, the GPT built whole,
``ft.TrainState.create``, ``ft.shard_state``). Reported per rank: the peak bytes alive while it
runs (``ftrain.testing.track_allocations``: storages allocated inside, at their size) against the
rank's shard of the state (``local_bytes``), and the median seconds. The two states are checked
bitwise equal first.
"""

from __future__ import annotations

import argparse
import os

import torch
from _common import interleaved, machine, write_section  # benchmarks/_common.py

import ftrain as ft
from ftrain import tree
from ftrain.distributed import local_bytes, run_distributed, shard_state, sharded_init
from ftrain.distributed.dtensor import is_dtensor, local
from ftrain.models import GPT, GPTConfig
from ftrain.testing import track_allocations

SECTION = "Born sharded"
MiB = 2**20


def _on_rank(d: int, n_layer: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    config = GPTConfig(vocab_size=257, seq_len=128, d_model=d, n_layer=n_layer, n_head=4,
                       matmul="torch")  # fmt: skip

    def born():
        return sharded_init(lambda: GPT(config), ft.optim.adamw(1e-4), "fsdp", seed=0)

    def whole():
        torch.manual_seed(0)
        state = ft.TrainState.create(ft.params_of(GPT(config)), ft.optim.adamw(1e-4), seed=0)
        return shard_state(state, "fsdp")

    a, b = born(), whole()
    for x, y in zip(tree.leaves(a.params) + tree.leaves(a.opt_state),
                    tree.leaves(b.params) + tree.leaves(b.opt_state), strict=True):  # fmt: skip
        assert torch.equal(local(x) if is_dtensor(x) else x, local(y) if is_dtensor(y) else y)
    out = {"shard": local_bytes(a), "params": sum(t.numel() * 4 for t in tree.leaves(a.params))}
    for name, fn in (("born", born), ("whole", whole)):
        with track_allocations() as mem:
            fn()
        out[f"{name}_peak"] = mem.peak
    out["seconds"] = interleaved({"born": born, "whole": whole}, repeats=repeats, warmup=1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny sizes, nothing written")
    args = ap.parse_args()
    d, n_layer, repeats = (64, 2, 1) if args.quick else (256, 8, 5)
    load = os.getloadavg()[0]
    ranks = run_distributed(_on_rank, 2, d, n_layer, repeats)
    rows = []
    for r, got in enumerate(ranks):
        s, t = got["shard"], got["seconds"]
        rows.append(
            f"| {r} | {s / MiB:.2f} | {got['born_peak'] / MiB:.2f} | {got['born_peak'] / s:.2f} | "
            f"{got['whole_peak'] / MiB:.2f} | {got['whole_peak'] / s:.2f} | "
            f"{t['born']:.3f} | {t['whole']:.3f} | {t['born'] / t['whole']:.2f} |"
        )
    body = f"""`python benchmarks/born.py` on {machine()}. Load average {load:.1f} at the start
(the machine is shared; the two ways are interleaved). GPT d={d}, {n_layer} blocks, AdamW, fsdp
on 2 gloo processes: params {ranks[0]["params"] / MiB:.2f} MiB whole; a rank's shard is its rows
of the params and both moments. Peak: the most bytes of storages allocated while the state is
created (`ftrain.testing.track_allocations`). Born, the peak is the finished shard itself: the
one whole parameter alive at a time comes before the moments exist (with SGD, no moments,
tests/distributed/data_parallel/test_born.py measures 1.04x). Time: median of {repeats}, the
recording on meta and the replay included. The two states are bitwise equal (checked first).

| rank | shard MiB | born peak MiB | / shard | whole-then-shard peak MiB | / shard | born s | whole s | born / whole |
| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
""" + "\n".join(rows)
    print(body)
    if not args.quick:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
