"""ft.offload under fsdp on 2 gloo processes: each block's gradient shards copied to the host
during backward (once reduce-scattered) against the copy after the whole backward.

    python benchmarks/offload_fsdp.py            # CPU, a GPT of width 256, 4 blocks; writes RESULTS.md
    python benchmarks/offload_fsdp.py --quick    # a smoke run at a tiny size, nothing written

Sides, each one donated AdamW step of the same GPT, each rank given half of the same batch:

* **fsdp**: ``ft.shard(step, "fsdp")`` (prefetch on, the default);
* **fsdp offload+grads per block**: ``ft.shard(ft.offload(step, "optimizer+gradients"),
  "fsdp")``: each block's reduced gradient shards copied into host transfer buffers during
  backward, one block after their reduce-scatter;
* **fsdp offload+grads after**: the same with the engine's sink dropped: the shards copied after
  the whole backward (what offload did under fsdp before).

On a CPU the host is the device: the copies are host-to-host memcpys with nothing to overlap, so
the per-block side's ratio to "after" is what those copies (and the hooks) cost; on a GPU they
would cross PCIe beside the rest of the backward. Timed in rounds with the order rotating
(``_common.rounds``) on every rank at once (the collectives keep them in step); rank 0 reports.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from _common import machine, rounds, write_section  # beside this script
from offload import WithoutSink  # beside this script

import ftrain as ft
from ftrain.distributed import run_distributed, shard_state
from ftrain.models import GPT, GPTConfig


def _on_rank(size: tuple, n: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    width, layers, rows, seq = size
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=seq, d_model=width, n_layer=layers, n_head=4))
    g = torch.Generator().manual_seed(1)
    whole = {k: torch.randint(0, 256, (rows, seq), generator=g) for k in ("input", "target")}
    half = rows // 2
    batch = {k: v[rank * half : (rank + 1) * half] for k, v in whole.items()}

    def loss_fn(params, b):
        return ft.losses.cross_entropy(ft.apply(model, params, b["input"]), b["target"])

    opt = ft.optim.adamw(3e-4, weight_decay=0.1)
    step = ft.train_step(loss_fn, opt, donate=True)
    per_block = ft.offload(step, "optimizer+gradients")
    steps = {
        "fsdp": ft.shard(step, "fsdp"),
        "fsdp offload+grads per block": ft.shard(per_block, "fsdp"),
        "fsdp offload+grads after": WithoutSink()(ft.shard(per_block, "fsdp")),
    }
    assert steps["fsdp offload+grads per block"].resolved.gradient_engine.sink is not None
    assert steps["fsdp offload+grads after"].resolved.gradient_engine.sink is None
    states = {}
    for k, s in steps.items():
        state = shard_state(ft.TrainState.create(ft.params_of(model), opt), "fsdp")
        states[k] = s.init_extra(state)

    def run(name):
        def call():
            states[name], _ = steps[name](states[name], batch)

        return call

    return rounds({k: run(k) for k in steps}, n)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # as each rank (machine() names it)
    size = (64, 2, 4, 32) if args.quick else (256, 4, 8, 128)  # width, blocks, rows, seq_len
    n = 3 if args.quick else args.rounds
    got = run_distributed(_on_rank, 2, size, n, args.threads, timeout=1200)[0]
    base = got["fsdp"]["wall"]
    rows = [f"| {k} | {v['wall'] * 1e3:.1f} | {v['wall'] / base:.2f}x |" for k, v in got.items()]
    ratio = got["fsdp offload+grads per block"]["wall"] / got["fsdp offload+grads after"]["wall"]
    body = "\n".join(
        [
            f"`python benchmarks/offload_fsdp.py` on {machine()}; 2 gloo processes, "
            f"{args.threads} torch thread(s) each; load average {os.getloadavg()[0]:.1f} while it "
            f"ran. A GPT of width {size[0]}, {size[1]} blocks, {size[2]} rows of {size[3]} "
            f"tokens (half per rank); one donated AdamW step, median of {n} rounds (rank 0).",
            "",
            "| side | ms per step | vs fsdp |",
            "| --- | --- | --- |",
            *rows,
            "",
            f"Gradient shards copied per block during backward vs after it: {ratio:.2f}x the "
            "step time. On a CPU the copies are host-to-host with nothing to overlap: the ratio is "
            "their cost. GPU numbers (the copies beside the backward): not yet measured.",
        ]
    )
    print(body)
    if not args.quick:
        write_section("Offload under fsdp (cpu, 2 processes)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
