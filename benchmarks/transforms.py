"""Transforms benchmark: ftrain's accumulate / checkpoint / autocast against the imperative
PyTorch way of each technique, side by side in one run.

    python benchmarks/transforms.py            # a few minutes on a 2-core CPU; writes RESULTS.md
    python benchmarks/transforms.py --quick    # a smoke run at a tiny size, nothing written

The model is ftrain's GPT (d=128, 4 blocks, seq 128, batch 16, AdamW). The imperative side is the
same module trained the usual way: ``loss.backward()`` and ``torch.optim.AdamW(foreach=True)``,
a manual accumulation loop, ``torch.utils.checkpoint`` applied in the blocks' forward, and
``torch.autocast`` around the forward.

Time: every variant runs once per round, rounds rotate the order, and each ratio is a ratio of
medians over the rounds, so a machine shared with other work slows both sides alike. Memory: the
bytes kept alive for backward after the forward of one (the first) micro-batch, counted by
``ftrain.testing.saved_bytes`` on both sides (``saved_activation_bytes`` for ftrain).

Threads: one by default. Targets are judged on CPU time, which a process waiting for a core does
not accumulate; but with two threads on a machine whose cores other work also wants, OpenMP's
threads spin while they wait for each other, and that spinning is CPU time too (it inflated
both sides' step about 3.5x here, and small micro-batches more than big ones). One thread gives
numbers that hold still; ``--threads 2`` measures both cores on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time

import torch
import torch.nn.functional as F
from _common import machine, write_section  # benchmarks/_common.py, beside this script
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ftrain as ft
from ftrain.models import GPT, GPTConfig
from ftrain.testing import saved_activation_bytes, saved_bytes

SECTION = "Transforms"  # the section of benchmarks/RESULTS.md this script writes
MICRO = 4  # micro-batches for accumulate


# -- the imperative way ---------------------------------------------------------------------------


class CheckpointedBlock(nn.Module):
    """A block whose forward goes through ``torch.utils.checkpoint``: the usual imperative way."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, *more):  # more: the block's other inputs (the GPT's attention mask)
        return torch_checkpoint(self.block, x, *more, use_reentrant=False)


def torch_step(model, opt, batch, micro=1, dtype=None):
    """One AdamW step the imperative way, over ``micro`` micro-batches.

    Each micro-batch backpropagates its summed token loss divided by the whole batch's token count,
    so the accumulated gradient is exactly that of the whole batch's mean.
    """
    opt.zero_grad(set_to_none=True)
    count = (batch["target"] != -100).sum()  # valid tokens in the whole batch
    for x, y in zip(batch["input"].tensor_split(micro), batch["target"].tensor_split(micro)):
        with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
            logits = model(x)  # (b, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
        (loss / count).backward()
    opt.step()


def torch_saved_bytes(model, batch, micro=1, dtype=None):
    """Bytes the imperative forward of the first micro-batch keeps for backward."""
    x, y = batch["input"].tensor_split(micro)[0], batch["target"].tensor_split(micro)[0]

    def forward():
        with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
            logits = model(x)
            return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")

    return saved_bytes(forward)


# -- the benchmark --------------------------------------------------------------------------------


def build(cfg: GPTConfig, batch_size: int):
    """Every variant, as a zero-argument function that takes one training step, and its bytes."""
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    batch = {"input": tokens[:, :-1], "target": tokens[:, 1:]}  # (B, T) each

    def loss_fn(params, batch):
        logits = ft.apply(model, params, batch["input"])  # (B, T, V)
        return ft.losses.cross_entropy(logits, batch["target"])

    opt = ft.optim.adamw(3e-4)
    plain = ft.train_step(loss_fn, opt)
    ftrain_steps = {
        "plain": plain,
        f"accumulate({MICRO})": ft.accumulate(plain, MICRO),
        "checkpoint(blocks)": ft.checkpoint(plain, "blocks"),
        "checkpoint(selective)": ft.checkpoint(plain, "selective"),
        "autocast(bf16)": ft.autocast(plain, torch.bfloat16),
    }
    torch_models = {"plain": model, "checkpoint(blocks)": copy.deepcopy(model)}
    ck = torch_models["checkpoint(blocks)"]
    ck.blocks = nn.ModuleList([CheckpointedBlock(b) for b in ck.blocks])
    torch_args = {  # variant -> (model, micro-batches, autocast dtype)
        "plain": (model, 1, None),
        f"accumulate({MICRO})": (model, MICRO, None),
        "checkpoint(blocks)": (ck, 1, None),
        "autocast(bf16)": (model, 1, torch.bfloat16),
    }

    runs, nbytes = {}, {}
    for name, step in ftrain_steps.items():
        box = [ft.TrainState.create(ft.params_of(model), opt)]

        def run(step=step, box=box):
            box[0], _ = step(box[0], batch)

        runs[("ftrain", name)] = run
        nbytes[("ftrain", name)] = saved_activation_bytes(step, box[0], batch)
    for name, (m, micro, dtype) in torch_args.items():
        m = copy.deepcopy(m)  # each variant trains its own copy
        adamw = torch.optim.AdamW(m.parameters(), lr=3e-4, foreach=True)
        runs[("torch", name)] = lambda m=m, o=adamw, k=micro, d=dtype: torch_step(m, o, batch, k, d)
        nbytes[("torch", name)] = torch_saved_bytes(m, batch, micro, dtype)
    return runs, nbytes


def measure(runs, rounds: int, warmup: int = 2) -> tuple[dict, dict]:
    """Median wall seconds and median CPU seconds (this process, all threads) per call of each
    run. Every round runs each once, in a rotating order."""
    names = list(runs)
    for _ in range(warmup):
        for n in names:
            runs[n]()
    wall, cpu = {n: [] for n in names}, {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            w0, c0 = time.perf_counter(), time.process_time()
            runs[n]()
            cpu[n].append(time.process_time() - c0)
            wall[n].append(time.perf_counter() - w0)
    median = lambda d: {n: statistics.median(ts) for n, ts in d.items()}  # noqa: E731
    return median(wall), median(cpu)


def report(wall: dict, cpu: dict, nbytes: dict, setup: str) -> str:
    """The markdown section: each ratio next to its target, then the raw numbers."""
    acc, ck, sel, bf = (
        f"accumulate({MICRO})",
        "checkpoint(blocks)",
        "checkpoint(selective)",
        "autocast(bf16)",
    )
    F_, T_ = "ftrain", "torch"
    rows = [  # (what, time or bytes, numerator, denominator, target)
        (f"ftrain {acc} / plain (same total batch)", "time", (F_, acc), (F_, "plain"), 1.10),
        (f"torch {acc} / plain", "time", (T_, acc), (T_, "plain"), None),
        (f"ftrain {ck} / plain", "time", (F_, ck), (F_, "plain"), 1.35),
        (f"ftrain {ck} / plain", "bytes", (F_, ck), (F_, "plain"), 0.35),
        (f"torch {ck} / plain", "time", (T_, ck), (T_, "plain"), None),
        (f"torch {ck} / plain", "bytes", (T_, ck), (T_, "plain"), None),
        (f"ftrain {sel} / plain", "time", (F_, sel), (F_, "plain"), None),
        (f"ftrain {sel} / plain", "bytes", (F_, sel), (F_, "plain"), None),
        (f"ftrain {bf} / plain (fp32)", "time", (F_, bf), (F_, "plain"), None),
        (f"torch {bf} / plain (fp32)", "time", (T_, bf), (T_, "plain"), None),
    ]
    for name in ("plain", acc, ck, bf):
        rows.append((f"ftrain / torch, {name}", "time", (F_, name), (T_, name), 1.05))
        rows.append((f"ftrain / torch, {name}", "bytes", (F_, name), (T_, name), None))

    lines = [
        setup,
        "",
        "| ratio | of | CPU time (judged) | wall time | bytes | target | met |",
        "| --- | --- | ---: | ---: | ---: | ---: | :---: |",
    ]
    for what, kind, a, b, target in rows:
        if kind == "time":
            value = cpu[a] / cpu[b]
            cells = f"{value:.3f} | {wall[a] / wall[b]:.3f} | "
        else:
            value = nbytes[a] / nbytes[b]
            cells = f" |  | {value:.3f}"
        tgt = "" if target is None else f"≤ {target:.2f}"
        met = "" if target is None else ("yes" if value <= target else "**no**")
        lines.append(f"| {what} | {kind} | {cells} | {tgt} | {met} |")
    lines += [
        "",
        "| variant | ftrain CPU ms | torch CPU ms | ftrain wall ms | torch wall ms "
        "| ftrain saved MiB | torch saved MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    fmt = lambda d, k, f: "" if k not in d else f(d[k])  # noqa: E731
    ms, mib = (lambda x: f"{x * 1e3:.0f}"), (lambda x: f"{x / 2**20:.2f}")
    for name in ("plain", acc, ck, sel, bf):
        f, t = (F_, name), (T_, name)
        lines.append(
            f"| {name} | {fmt(cpu, f, ms)} | {fmt(cpu, t, ms)} | {fmt(wall, f, ms)} "
            f"| {fmt(wall, t, ms)} | {fmt(nbytes, f, mib)} | {fmt(nbytes, t, mib)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run; RESULTS.md is not written")
    ap.add_argument("--rounds", type=int, default=31, help="interleaved rounds (default 31)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: see the module docstring)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        cfg, batch_size, rounds = GPTConfig(seq_len=32, d_model=32, n_layer=4, n_head=2), 8, 2
    else:
        cfg = GPTConfig(seq_len=128, d_model=128, n_layer=4, n_head=4)
        batch_size, rounds = 16, args.rounds
    load = os.getloadavg()[0]
    runs, nbytes = build(cfg, batch_size)
    wall, cpu = measure(runs, rounds)
    setup = (
        f"`python benchmarks/transforms.py` on {machine()}. GPT d={cfg.d_model}, {cfg.n_layer} "
        f"blocks, seq "
        f"{cfg.seq_len}, batch {batch_size}, AdamW, accumulate over {MICRO} micro-batches; median "
        f"of {rounds} interleaved rounds. Load average {load:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end: the machine may be shared, so targets are judged "
        "on CPU time (this process's, all threads), which waiting for a core does not inflate; "
        "wall time is shown beside it (one thread by default: see the script's docstring). "
        "Saved bytes: what the forward of the first micro-batch keeps for backward."
    )
    body = report(wall, cpu, nbytes, setup)
    print(f"## {SECTION}\n\n{body}")
    if not args.quick:
        write_section(SECTION, body)
        print(f"wrote the {SECTION!r} section of benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
