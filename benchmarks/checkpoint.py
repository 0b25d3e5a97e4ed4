"""Checkpoint benchmark: save time, steps during a background save, sharded saves' bytes per rank.

    python benchmarks/checkpoint.py            # about two minutes on a 2-core CPU; writes RESULTS.md
    python benchmarks/checkpoint.py --quick    # a smoke run at a tiny size, nothing written

Questions, each answered in one run, the sides interleaved, as ratios of medians:

1. Save and load time of a whole state: ``ft.save`` / ``ft.load`` (safetensors, sha256-verified,
   fsynced, atomic) beside ``torch.save`` / ``torch.load`` of the same tensors (pickle, no fsync).
2. Does a save stall training? The step time of steps taken while ``ft.save(...,
   blocking=False)`` writes in the background, against steps with no save (target <= 1.10x), and
   the time the training loop waits at the save call: the host copy of a background save against
   the whole write of a blocking one.
3. Sharded saves (2 processes, fsdp): bytes each rank writes against the whole state, and the
   save time against gathering the state whole and writing it from rank 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import machine, write_section  # benchmarks/_common.py

import ftrain as ft
from ftrain.distributed import local_bytes, run_distributed, shard_state, unshard_state
from ftrain.models import GPT, GPTConfig

SECTION = "Checkpoints"
MiB = 2**20


def build(d: int, n_layer: int, seq: int):
    """A GPT with AdamW (state: params + 2 moments), its step and a batch of 2 rows of 32 tokens:
    a step a little shorter than a save, so that several steps run while one is written."""
    cfg = GPTConfig(vocab_size=257, seq_len=seq, d_model=d, n_layer=n_layer, n_head=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ft.optim.adamw(1e-4)

    def loss_fn(params, b):
        return ft.losses.cross_entropy(ft.apply(model, params, b["input"]), b["target"])

    step = ft.train_step(loss_fn, opt)
    state = ft.TrainState.create(ft.params_of(model), opt)
    x = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))  # (B, T)
    return step, state, {"input": x, "target": torch.roll(x, -1, dims=1)}


def timed(fn, *args) -> float:
    """Seconds that ``fn(*args)`` takes."""
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def save_and_load(state, root: Path, repeats: int) -> dict[str, float]:
    """Median seconds of ft.save / ft.load and of torch.save / torch.load of the same tensors."""
    flat = dict(state.to_tensordict().flatten_keys(".").items())
    times: dict[str, list[float]] = {
        k: [] for k in ("ft.save", "ft.load", "torch.save", "torch.load")
    }
    for _ in range(repeats):
        times["ft.save"].append(timed(lambda: ft.save(state, root / "ft")))
        times["ft.load"].append(timed(lambda: ft.load(root / "ft")))
        times["torch.save"].append(timed(lambda: torch.save(flat, root / "torch.pt")))
        times["torch.load"].append(timed(lambda: torch.load(root / "torch.pt")))
    return {k: statistics.median(v) for k, v in times.items()}


def steps_during_saves(step, state, batch, root: Path, rounds: int) -> dict[str, float]:
    """Per round: steps with no save, then a background save and the steps taken until it has
    committed, then a blocking save. Returns medians: step seconds without and during a save,
    the wait at a background save call, and the wait at a blocking save."""
    plain, during, wait_bg, wait_block = [], [], [], []
    for _ in range(2):
        state, _ = step(state, batch)  # warm-up
    for r in range(rounds):
        for _ in range(5):
            t = time.perf_counter()
            state, m = step(state, batch)
            float(m["loss"])
            plain.append(time.perf_counter() - t)
        t = time.perf_counter()
        handle = ft.save(state, root / f"bg-{r % 2}", blocking=False)
        wait_bg.append(time.perf_counter() - t)
        while not handle.done():
            t = time.perf_counter()
            state, m = step(state, batch)
            float(m["loss"])
            during.append(time.perf_counter() - t)
        handle.wait()
        wait_block.append(timed(ft.save, state, root / f"block-{r % 2}"))
    med = statistics.median
    return {"step": med(plain), "step during save": med(during) if during else float("nan"),
            "steps during save": len(during) / rounds, "wait background": med(wait_bg),
            "wait blocking": med(wait_block)}  # fmt: skip


def _sharded_on_rank(d: int, n_layer: int, seq: int, root: str, repeats: int) -> dict:
    """On each of 2 processes: fsdp's sharded save against gathering whole + rank 0 saving."""
    torch.set_num_threads(1)
    _, state, _ = build(d, n_layer, seq)
    sharded = shard_state(state, "fsdp")
    rank = torch.distributed.get_rank()
    t_sharded, t_gathered = [], []
    for _ in range(repeats):
        torch.distributed.barrier()
        t_sharded.append(timed(lambda: ft.save(sharded, f"{root}/sharded")))

        def gather_then_save():
            whole = unshard_state(sharded)
            if rank == 0:
                ft.save(whole, f"{root}/gathered")
            torch.distributed.barrier()

        torch.distributed.barrier()
        t_gathered.append(timed(gather_then_save))
    mine = Path(root, "sharded", f"rank-{rank:05d}-of-00002.safetensors").stat().st_size
    return {"sharded": statistics.median(t_sharded), "gathered": statistics.median(t_gathered),
            "file": mine, "local": local_bytes(sharded), "whole": local_bytes(state)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny sizes, nothing written")
    args = ap.parse_args()
    d, n_layer, seq, repeats, rounds = (
        (64, 2, 32, 2, 2) if args.quick else (256, 8, 128, 5, 6)
    )  # fmt: skip
    # One torch thread: the step keeps one core, the background writer gets the other (on a
    # shared 2-core machine two intra-op threads contend with every other process).
    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    step, state, batch = build(d, n_layer, seq)
    whole = local_bytes(state)
    root = Path(tempfile.mkdtemp(prefix="ftrain-bench-ckpt-"))
    try:
        io = save_and_load(state, root, repeats)
        print("save/load s:", {k: round(v, 3) for k, v in io.items()}, flush=True)
        during = steps_during_saves(step, state, batch, root, rounds)
        print("steps:", {k: round(v, 4) for k, v in during.items()}, flush=True)
        shard = run_distributed(_sharded_on_rank, 2, d, n_layer, seq, str(root / "dist"), repeats)
        print("sharded:", shard, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_end = os.getloadavg()[0]
    if args.quick:
        return
    rate = whole / MiB / io["ft.save"]
    ratio = during["step during save"] / during["step"]
    rows = [
        "| | seconds | / torch | MiB/s |",
        "| --- | ---: | ---: | ---: |",
        f"| ft.save (blocking) | {io['ft.save']:.3f} | {io['ft.save'] / io['torch.save']:.2f} | {rate:.0f} |",
        f"| torch.save | {io['torch.save']:.3f} | 1.00 | {whole / MiB / io['torch.save']:.0f} |",
        f"| ft.load (verified) | {io['ft.load']:.3f} | {io['ft.load'] / io['torch.load']:.2f} | {whole / MiB / io['ft.load']:.0f} |",
        f"| torch.load | {io['torch.load']:.3f} | 1.00 | {whole / MiB / io['torch.load']:.0f} |",
    ]  # fmt: skip
    steps = [
        "| | ms | / step with no save |",
        "| --- | ---: | ---: |",
        f"| step, no save | {during['step'] * 1e3:.0f} | 1.00 |",
        f"| step while a background save writes | {during['step during save'] * 1e3:.0f} | {ratio:.2f} |",
        f"| wait at `ft.save(..., blocking=False)` (host copy) | {during['wait background'] * 1e3:.0f} | {during['wait background'] / during['step']:.2f} |",
        f"| wait at a blocking `ft.save` | {during['wait blocking'] * 1e3:.0f} | {during['wait blocking'] / during['step']:.2f} |",
    ]  # fmt: skip
    r0, r1 = shard
    sharded = [
        "| | rank 0 | rank 1 |",
        "| --- | ---: | ---: |",
        f"| bytes written (MiB) | {r0['file'] / MiB:.2f} | {r1['file'] / MiB:.2f} |",
        f"| / whole state ({r0['whole'] / MiB:.2f} MiB) | {r0['file'] / r0['whole']:.2f} | {r1['file'] / r1['whole']:.2f} |",
        f"| sharded save s | {r0['sharded']:.3f} | {r1['sharded']:.3f} |",
        f"| gather whole + rank 0 saves s | {r0['gathered']:.3f} | {r1['gathered']:.3f} |",
    ]  # fmt: skip
    body = f"""
`python benchmarks/checkpoint.py` on {machine()}. Load average {load_start:.1f} at the start and
{load_end:.1f} at the end (the machine is shared; the sides of each comparison are interleaved).
GPT d={d}, {n_layer} blocks, AdamW: a state of {whole / MiB:.1f} MiB (params and two moments,
fp32), on the local disk; steps of 2 rows of 32 tokens. ft.save hashes (sha256) and fsyncs every file and commits the
directory atomically; torch.save pickles and does neither. Median of {repeats} saves and loads.

{chr(10).join(rows)}

Training while a checkpoint is written (median of {rounds} rounds of 5 steps with no save, one
background save with the steps taken until it commits (about {during["steps during save"]:.0f} a
save), and one blocking save). Target for the step during a background save: <= 1.10x. The
writer thread runs at nice +10, so on a machine whose cores are all busy the step goes first and
the save takes longer than a blocking one; with a free core it takes about as long.

{chr(10).join(steps)}

Sharded saves on 2 processes (gloo, one thread each), fsdp: each rank writes only its pieces
(plus rank 0 the few whole tensors: step, rng, counters) and one index; against gathering the
state whole on every rank and writing it from rank 0.

{chr(10).join(sharded)}
"""
    write_section(SECTION, body)


if __name__ == "__main__":
    main()
