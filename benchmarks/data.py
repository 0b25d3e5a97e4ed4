"""Data benchmark: ftrain.data.loader against torch.utils.data.DataLoader, and against no loader.

    python benchmarks/data.py            # about two minutes on a 2-core CPU; writes RESULTS.md
    python benchmarks/data.py --quick    # a smoke run, nothing written

Questions, each answered by measuring both sides in the same run, interleaved, as ratios of medians:

1. Throughput: batches/s of `ft.data.loader` and of `DataLoader` on the same TokenDataset
   (the standard library, seq 128, batch 16), 0 and 2 workers, steady state and time to first batch.
2. Is the loader ever the bottleneck? A training step (small GPT, AdamW, plain PyTorch) fed by the
   live loader against the same step on batches built beforehand. Target: ratio <= 1.03.
3. Padding: fraction of padded positions of variable-length documents, random vs length-bucketed.
4. On a CUDA machine: host-to-device copy time of pinned vs pageable batches.
5. Packing: useful (predicted, not padding) tokens per second of a training step on documents of a
   skewed length distribution, packed into full rows (`TokenDataset(pack=True)`: the GPT's
   block-diagonal mask, positions restarting per document) against one document per row padded
   (`DocumentDataset` + `PadCollate`, random and length-bucketed batches). Target: >= 1.5x.
   `python benchmarks/data.py --packing` runs only this one and writes its own section.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _common import RESULTS, machine, write_section  # benchmarks/_common.py
from torch import nn

from ftrain import data

SECTION = "Data"
PACK_SECTION = "Data: packed vs padded"


# -- a small GPT in plain PyTorch (the default model's size) ----------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=257, seq=128, d=128, n_layer=4, n_head=4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):  # (B, T) -> (B, T, vocab)
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_step(model, opt):
    def step(batch):
        logits = model(batch["input"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()  # host sync: the step is really done when the timer stops

    return step


# -- measurements ----------------------------------------------------------------------------------


def pull(it, k: int) -> float:
    """Batches per second pulling k batches from a running iterator."""
    t = time.perf_counter()
    for _ in range(k):
        next(it)
    return k / (time.perf_counter() - t)


def first_batch_s(make) -> float:
    t = time.perf_counter()
    next(iter(make()))
    return time.perf_counter() - t


def throughput(ds, rounds: int, k: int) -> list[dict]:
    rows = []
    for workers in (0, 2):
        ft_loader = data.loader(ds, 16, seed=0, num_workers=workers, infinite=True)
        dl = torch.utils.data.DataLoader(
            ds,
            16,
            shuffle=True,
            num_workers=workers,
            drop_last=True,
            persistent_workers=workers > 0,
        )
        ft_it, dl_it = iter(ft_loader), iter(dl)
        pull(ft_it, 20), pull(dl_it, 20)  # warm up
        ft_rates, dl_rates = [], []
        for r in range(rounds):  # interleaved, the side that goes first alternates
            for side in (0, 1) if r % 2 == 0 else (1, 0):
                if side == 0:
                    ft_rates.append(pull(ft_it, k))
                else:
                    dl_rates.append(pull(dl_it, k))
        ft_first = [
            first_batch_s(lambda w=workers: data.loader(ds, 16, seed=0, num_workers=w))
            for _ in range(3)
        ]
        dl_first = [
            first_batch_s(lambda w=workers: torch.utils.data.DataLoader(ds, 16, num_workers=w))
            for _ in range(3)
        ]
        del dl_it
        rows.append(
            dict(
                workers=workers,
                ft=statistics.median(ft_rates),
                dl=statistics.median(dl_rates),
                ft_first=statistics.median(ft_first),
                dl_first=statistics.median(dl_first),
            )
        )
    return rows


def fed_step(ds, rounds: int, steps: int, workers: int) -> dict:
    """Step times fed by the live loader and by pre-built batches, in alternating blocks.

    Wall clock, median per step. The two sides alternate in blocks (and which goes first
    alternates), so both see the same background load of a shared machine; the loader refills
    its prefetch queue during the live block, so its work is charged to the live side.
    """
    torch.manual_seed(0)
    model = TinyGPT()
    step = make_step(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    it = iter(data.loader(ds, 16, seed=0, num_workers=workers, infinite=True))
    prebuilt = [ds[i] for i in range(16 * steps)]
    prebuilt = [data.stack_collate(prebuilt[i : i + 16]) for i in range(0, len(prebuilt), 16)]
    for i in range(3):  # warm up both paths
        step(next(it)), step(prebuilt[i])
    wall: dict[str, list[float]] = {"live": [], "fixed": [], "wait": []}
    for r in range(rounds):
        for side in ("live", "fixed") if r % 2 == 0 else ("fixed", "live"):
            for i in range(steps):
                t = time.perf_counter()
                if side == "live":
                    batch = next(it)  # waits only if the prefetched batch is not ready
                    wall["wait"].append(time.perf_counter() - t)
                else:
                    batch = prebuilt[i]
                step(batch)
                wall[side].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in wall.items()}
    return dict(
        workers=workers,
        live_ms=1e3 * med["live"],
        fixed_ms=1e3 * med["fixed"],
        wait_ms=1e3 * med["wait"],
        ratio=med["live"] / med["fixed"],
        steps=len(wall["live"]),
    )


class Lognormal:
    """Synthetic variable-length examples: lengths ~ lognormal (median 100), capped at 2048."""

    def __init__(self, n: int = 20_000):
        gen = torch.Generator().manual_seed(0)
        self.lengths = (torch.randn(n, generator=gen) * 0.8 + 4.6).exp().clamp(1, 2048).long()
        self.collate = data.PadCollate()

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        t = torch.zeros(int(self.lengths[i]), dtype=torch.long)
        return {"input": t, "target": t}


def padding(ds, name: str) -> dict:
    out = dict(name=name, examples=len(ds))
    for name, order in (("random", "shuffle"), ("bucketed", "length")):
        real = total = 0
        for b in data.loader(ds, 16, seed=0, order=order):
            real += int(b["mask"].sum())
            total += b["mask"].numel()
        out[name] = 1 - real / total
    return out


def h2d_copy(rounds: int = 50) -> list[dict]:
    rows = []
    for shape in ((16, 128), (64, 2048), (256, 4096)):
        pageable = torch.randint(0, 257, shape)
        pinned = pageable.pin_memory()
        times = {"pageable": [], "pinned": []}
        for _ in range(rounds):
            for name, src in (("pageable", pageable), ("pinned", pinned)):
                torch.cuda.synchronize()
                t = time.perf_counter()
                src.to("cuda", non_blocking=True)
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t)
        med = {k: 1e6 * statistics.median(v) for k, v in times.items()}
        rows.append(dict(shape=shape, **med, ratio=med["pinned"] / med["pageable"]))
    return rows


def skewed_docs(n: int = 3000) -> list[tuple[str, str]]:
    """Texts of lognormal lengths (median 48 bytes, a long tail to 2048): most short, a few long."""
    gen = torch.Generator().manual_seed(0)
    lengths = (torch.randn(n, generator=gen) * 1.1 + 3.9).exp().clamp(8, 2048).long()
    letters = torch.randint(97, 123, (int(lengths.sum()),), generator=gen).tolist()
    text, out, at = "".join(map(chr, letters)), [], 0
    for i, n_i in enumerate(lengths.tolist()):
        out.append((str(i), text[at : at + n_i]))
        at += n_i
    return out


def packed_vs_padded(tmp: str, rounds: int, steps: int, T: int = 256, B: int = 8) -> dict:
    """Useful tokens per second of the same GPT step fed packed rows or padded documents."""
    from ftrain.models import GPT, GPTConfig

    build = data.build_token_dataset(skewed_docs(), tmp, progress=False)
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=T, d_model=128, n_layer=4, n_head=4, matmul="torch"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        packed = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        logits = model(batch["input"], **packed)  # (B, t, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()  # host sync

    docs = data.DocumentDataset(tmp, T, splits=(1, 0, 0))
    feeds = {
        "packed": data.loader(
            data.TokenDataset(tmp, T, pack=True, splits=(1, 0, 0)), B, infinite=True
        ),
        "padded, random": data.loader(docs, B, infinite=True),
        "padded, bucketed": data.loader(docs, B, infinite=True, order="length"),
    }
    its = {k: iter(v) for k, v in feeds.items()}
    useful = {k: 0 for k in feeds}
    seconds = {k: 0.0 for k in feeds}
    for r in range(rounds + 1):  # round 0 warms up
        for k, it in its.items():
            batches = [next(it) for _ in range(steps)]  # read outside the timer
            t = time.perf_counter()
            for b in batches:
                step(b)
            if r:
                seconds[k] += time.perf_counter() - t
                useful[k] += sum(int((b["target"] != -100).sum()) for b in batches)
    for it in its.values():
        it.close()
    rate = {k: useful[k] / seconds[k] for k in feeds}
    lengths = docs.lengths
    return dict(build=build, rate=rate, T=T, B=B, steps=rounds * steps, mean=float(lengths.mean()),
                median=float(np.median(lengths)), max=int(lengths.max()))  # fmt: skip


def pack_report(p: dict, load: str) -> str:
    b = p["build"]
    lines = [
        f"`python benchmarks/data.py --packing` on {machine()}. 1-minute load average at start and "
        f"end: {load} (above 2 the machine was shared with other jobs; every mode ran in each "
        "round, in turn, so load changes hit all alike).",
        f"Data: {b.num_docs:,} synthetic byte documents of lognormal length (mean {p['mean']:.0f}, "
        f"median {p['median']:.0f}, longest {p['max']} tokens, cut at {p['T']}); the built-in GPT "
        f"(d 128, 4 layers, 4 heads), AdamW, batches of {p['B']} rows of at most {p['T']} "
        f"tokens, {p['steps']} timed steps per mode. Useful tokens: targets that are predicted "
        "(not padding).",
        "",
        "| rows | useful tokens/s | packed / this |",
        "| --- | --- | --- |",
    ]
    for k, v in p["rate"].items():
        lines.append(f"| {k} | {v:,.0f} | {p['rate']['packed'] / v:.2f}x |")
    return "\n".join(lines) + "\n"


# -- report ----------------------------------------------------------------------------------------


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def report(build, tput, fed, pads, h2d, load: str) -> str:
    lines = [
        f"`python benchmarks/data.py` on {machine()}. 1-minute load average at start and end: "
        f"{load} (above the core count the machine was shared with other jobs: wall-clock times "
        "are noisy, and the time spent waiting in next() is the direct measure of the loader "
        "holding up a step).",
        f"Corpus: the standard library, {build.num_docs} files, {build.num_tokens:,} byte tokens, "
        f"built in {build.seconds:.2f} s. Batches: 16 x 128 tokens, shuffled, drop_last.",
        "",
        "Loader throughput, steady state (batches/s, median of interleaved rounds), and time to "
        "the first batch of a new iterator:",
        "",
        "| workers | ft.data.loader | DataLoader | ratio | first batch ft / DataLoader |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in tput:
        lines.append(
            f"| {r['workers']} | {r['ft']:,.0f} | {r['dl']:,.0f} | {r['ft'] / r['dl']:.2f} | "
            f"{1e3 * r['ft_first']:.1f} ms / {1e3 * r['dl_first']:.1f} ms |"
        )
    lines += [
        "",
        "Training step (plain-PyTorch GPT, d 128, 4 layers, 4 heads, AdamW) fed by the live loader "
        "against the same step on batches built beforehand (target <= 1.03):",
        "",
        "| loader workers | live (ms/step) | of which next() | pre-built (ms/step) | ratio of medians | steps each |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in fed:
        lines.append(
            f"| {r['workers']} | {r['live_ms']:.1f} | {r['wait_ms']:.3f} | {r['fixed_ms']:.1f} | "
            f"{r['ratio']:.3f} | {r['steps']} |"
        )
    cost_ms = 1e3 / tput[0]["ft"]
    lines += [
        "",
        f"For scale: the loader's whole per-batch work (read, collate, queues) is {cost_ms:.2f} ms "
        f"in the steady state, {cost_ms / fed[0]['fixed_ms']:.2%} of a step, and it runs in a "
        "background thread while the step computes.",
    ]
    lines += [
        "",
        "Padding of variable-length examples, batch 16, one epoch (`DocumentDataset`: each file "
        "cut into pieces of at most max_len tokens; only a file's last piece is shorter):",
        "",
        "| examples | count | random batches | length-bucketed | reduction |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in pads:
        lines.append(
            f"| {r['name']} | {r['examples']:,} | {r['random']:.1%} | {r['bucketed']:.1%} | "
            f"{r['random'] / max(r['bucketed'], 1e-9):.1f}x |"
        )
    lines.append("")
    if h2d:
        lines += [
            "Host-to-device copy, `non_blocking=True`, median of 50 (us):",
            "",
            "| batch (int64) | pageable | pinned | pinned / pageable |",
            "| --- | --- | --- | --- |",
        ]
        for r in h2d:
            lines.append(
                f"| {r['shape'][0]} x {r['shape'][1]} | {r['pageable']:.0f} | {r['pinned']:.0f} | "
                f"{r['ratio']:.2f} |"
            )
    else:
        lines.append(
            "Pinned vs pageable host-to-device copy: not measured, this machine has no GPU "
            "(the benchmark measures it when CUDA is available)."
        )
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run; RESULTS.md is not written")
    ap.add_argument("--packing", action="store_true", help="only question 5 (packed vs padded)")
    args = ap.parse_args()
    rounds, k, steps = (2, 50, 3) if args.quick else (16, 100, 8)
    load_start = loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        p = packed_vs_padded(tmp, *((1, 2) if args.quick else (4, 6)))
    pack_section = pack_report(p, f"{load_start} / {loadavg()}")
    print(pack_section)
    if not args.quick:
        write_section(PACK_SECTION, pack_section)
    if args.packing:
        return

    with tempfile.TemporaryDirectory() as tmp:
        build = data.build_token_dataset(data.corpora.python_stdlib(), tmp, progress=False)
        train = data.TokenDataset(tmp, 128, seed=0, split="train")
        print(f"corpus: {build.num_docs} docs, {build.num_tokens:,} tokens, {build.seconds:.2f} s")
        tput = throughput(train, rounds, k)
        print("throughput", tput)
        fed = [fed_step(train, rounds, steps, workers) for workers in (0, 2)]
        print("fed step", fed)
        pads = [
            padding(data.DocumentDataset(tmp, n), f"stdlib files, max_len {n}")
            for n in (256, 1024, 4096, 16384)
        ]
        pads.append(padding(Lognormal(), "synthetic, lognormal lengths (median 100)"))
        print("padding", pads)
        h2d = h2d_copy() if torch.cuda.is_available() else []
        print("h2d", h2d)
    section = report(build, tput, fed, pads, h2d, f"{load_start} / {loadavg()}")
    print(section)
    if not args.quick:
        write_section(SECTION, section)
        print(f"wrote the '## {SECTION}' section of {RESULTS}")


if __name__ == "__main__":
    main()
