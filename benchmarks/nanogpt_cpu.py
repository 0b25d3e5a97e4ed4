"""The CPU matmul kernel that ``GPTConfig(matmul="auto")`` picks, and ftrain against nanoGPT's own
``train.py`` on nanoGPT's CPU baby GPT.

    python benchmarks/nanogpt_cpu.py                          # the kernels only; writes RESULTS.md
    python benchmarks/nanogpt_cpu.py --nanogpt /tmp/nanoGPT   # also nanoGPT's train.py, side by side
    python benchmarks/nanogpt_cpu.py --quick                  # a smoke run, nothing written

Part 1, kernels: one donated AdamW step (``ft.train_step(..., donate=True)``) with the linears'
matmuls forced to oneDNN (``matmul="onednn"``), forced to torch's own (``"torch"``: MKL on x86),
and as ``"auto"`` resolves them on this machine (``choose_matmul`` at the run's batch * seq_len
rows), interleaved, as ratios to ``"torch"``. Two models: nanoGPT's CPU baby GPT (its README's CPU
command: vocab 65, 4 layers, 4 heads, 128 wide, block 64, batch 12, no bias, dropout 0) and
``ftrain train``'s default (vocab 257, 4 layers, 2 heads, 128 wide, seq 128, batch 16, no bias).
Then the linears alone, as ``auto`` times them (``time_linears``), at 256 to 8192 rows: where on
this processor oneDNN starts to win.

Part 2, ``--nanogpt DIR`` (a checkout of karpathy/nanoGPT; nothing of it is imported): its
``train.py`` with ``config/train_shakespeare_char.py`` and the README's CPU flags, on a
character-level dataset that this script writes in nanoGPT's format (``train.bin``/``val.bin`` of
uint16 ids, ``meta.pkl`` with the vocabulary) under ``DIR/data/ftrain_stdlib_char/``, from the
Python standard library's sources (no download). Its per-iteration times come from its own log
(``iter N: ... time X ms``: batch, forward, backward, clipping, AdamW, ``loss.item()``). ftrain's
side runs the same loop: the same random crops of the same ``train.bin`` read through
``np.memmap``, one donated step (AdamW, warmup + cosine schedule, decay on matrices, clipping at
1), ``float(loss)``. The runs alternate, each ``--iters`` iterations; medians over iterations
after the first ten. The target: ftrain within 1.05x of nanoGPT.

``--threads N`` sets torch's threads for both sides (nanoGPT through ``OMP_NUM_THREADS``); the
default, 1, keeps OpenMP's spinning threads out of the CPU times on a shared machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _common import machine, rounds, write_section  # benchmarks/_common.py, beside this script

import ftrain as ft
from ftrain.models import GPT, GPTConfig, choose_matmul
from ftrain.models.gpt import linear_shapes
from ftrain.models.onednn import time_linears

SECTION = "CPU matmul kernels and nanoGPT"
# nanoGPT's README CPU run of config/train_shakespeare_char.py: the flags, and the model they give
NANOGPT_FLAGS = ["--device=cpu", "--compile=False", "--dtype=float32", "--eval_iters=20",
                 "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4",
                 "--n_head=4", "--n_embd=128", "--lr_decay_iters=2000", "--dropout=0.0"]  # fmt: skip
MODELS = {  # name: (GPTConfig fields, batch rows)
    "nanoGPT baby": (dict(vocab_size=65, seq_len=64, d_model=128, n_layer=4, n_head=4), 12),
    "ftrain train default": (
        dict(vocab_size=257, seq_len=128, d_model=128, n_layer=4, n_head=2),
        16,
    ),
}
LR, MIN_LR, WARMUP, DECAY_ITERS, WD, CLIP, B2 = 1e-3, 1e-4, 100, 2000, 0.1, 1.0, 0.99
LINEARS = {  # the linears of: (part 1's models, and nanoGPT's GPU baby GPT, 6 x 384)
    "d 128, vocab 65 (nanoGPT CPU baby)": MODELS["nanoGPT baby"][0],
    "d 128, vocab 257 (ftrain train)": MODELS["ftrain train default"][0],
    "d 384, vocab 65 (nanoGPT GPU baby)": dict(vocab_size=65, d_model=384, n_layer=6, n_head=6),
}
LINEAR_ROWS = (256, 768, 2048, 8192)
DATASET = "ftrain_stdlib_char"
TARGET = 1.05
SKIP = 10  # iterations of each run left out of the times: warm-up (allocations, lazy inits)


def cpu_family_model() -> str:
    """``cpu family F, model M`` from /proc/cpuinfo (what tells one processor generation from
    another where the model name is only "AMD EPYC"), or ``""``."""
    try:
        info = dict(
            (k.strip(), v.strip())
            for k, _, v in (line.partition(":") for line in open("/proc/cpuinfo"))
            if k.strip() in ("cpu family", "model")
        )
    except OSError:
        return ""
    return f"cpu family {info.get('cpu family', '?')}, model {info.get('model', '?')}"


def make_step(fields: dict, rows: int, matmul: str):
    """(donated step, state, model) for a GPT of ``fields``; ``matmul`` "auto" is resolved at the
    run's ``rows`` (batch * seq_len) as an app would: ``choose_matmul(config, rows)``."""
    config = GPTConfig(**fields, bias=False, dropout=0.0, matmul=matmul)
    config = dataclasses.replace(config, matmul=choose_matmul(config, rows * config.seq_len))
    torch.manual_seed(0)
    model = GPT(config)

    def loss_fn(params, b):
        return ft.losses.cross_entropy(ft.apply(model, params, b["input"]), b["target"])

    schedule = ft.optim.warmup_cosine(LR, WARMUP, DECAY_ITERS, end_value=MIN_LR)
    adamw = ft.optim.adamw(schedule, b2=B2, weight_decay=WD, mask=ft.optim.decay_mask)
    opt = ft.optim.chain(ft.optim.clip_by_global_norm(CLIP), adamw)
    step = ft.train_step(loss_fn, opt, donate=True)
    return step, ft.TrainState.create(ft.params_of(model), opt), model


def kernel_rows(n_rounds: int, quick: bool) -> list[str]:
    """Part 1: for each model, ms per donated step with each kernel, interleaved."""
    out = []
    for name, (fields, rows) in MODELS.items():
        if quick:
            fields = {**fields, "n_layer": 1}
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(0, fields["vocab_size"], (rows, fields["seq_len"] + 1), generator=g)
        batch = {"input": idx[:, :-1], "target": idx[:, 1:]}
        sides, picked = {}, ""
        for matmul in ("torch", "onednn", "auto"):
            step, state, model = make_step(fields, rows, matmul)
            if matmul == "auto":
                picked = model.matmul
            box = [state]

            def run(step=step, box=box, batch=batch) -> None:
                box[0], metrics = step(box[0], batch)

            sides[matmul] = run
        t = rounds(sides, n_rounds)
        cpu = {k: t[k]["cpu"] * 1e3 for k in t}
        wall = {k: t[k]["wall"] / t["torch"]["wall"] for k in t}
        out.append(
            f"| {name} | {cpu['torch']:.1f} | {cpu['onednn']:.1f} ({cpu['onednn'] / cpu['torch']:.2f}x"
            f", wall {wall['onednn']:.2f}x) | {cpu['auto']:.1f} ({cpu['auto'] / cpu['torch']:.2f}x, "
            f"wall {wall['auto']:.2f}x) | {picked} |"
        )
        print(out[-1], flush=True)
    return out


def linears_rows(quick: bool) -> list[str]:
    """The linears alone (``time_linears``: forward and both gradients of each model's linear
    shapes, best of its passes): oneDNN's time over torch's at a range of rows."""
    out = []
    for name, fields in LINEARS.items():
        shapes = linear_shapes(GPTConfig(**fields))
        ratios = []
        for rows in (256, 1024) if quick else LINEAR_ROWS:
            seconds = time_linears(shapes, rows, seconds=0.2 if quick else 2.0)
            ratios.append(seconds["onednn"] / seconds["torch"])
        out.append(f"| {name} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
        print(out[-1], flush=True)
    return out


# -- part 2: nanoGPT's train.py ------------------------------------------------------------------


def write_dataset(nanogpt: Path, chars: int) -> tuple[Path, int]:
    """nanoGPT's shakespeare_char format from the standard library's sources: ``chars``
    characters, 90% train, 10% val, ids in sorted-character order. Returns (dir, vocab size)."""
    text, size = [], 0
    for path in ft.data.corpora.python_stdlib():
        try:
            piece = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text.append("".join(c for c in piece if c.isascii()))  # a vocabulary of at most 128
        size += len(text[-1])
        if size >= chars:
            break
    data = "".join(text)[:chars]
    vocab = sorted(set(data))
    stoi = {c: i for i, c in enumerate(vocab)}
    ids = np.array([stoi[c] for c in data], dtype=np.uint16)
    out = nanogpt / "data" / DATASET
    out.mkdir(parents=True, exist_ok=True)
    cut = int(0.9 * len(ids))
    ids[:cut].tofile(out / "train.bin")
    ids[cut:].tofile(out / "val.bin")
    meta = {"vocab_size": len(vocab), "itos": dict(enumerate(vocab)), "stoi": stoi}
    with open(out / "meta.pkl", "wb") as f:  # nanoGPT reads its vocabulary with pickle
        pickle.dump(meta, f)
    return out, len(vocab)


def nanogpt_run(nanogpt: Path, iters: int, out_dir: Path, threads: int) -> tuple[float, list]:
    """nanoGPT's train.py for ``iters`` iterations: (CPU seconds of the whole process, its logged
    wall ms per iteration)."""
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", *NANOGPT_FLAGS,
           f"--dataset={DATASET}", f"--max_iters={iters}", f"--eval_interval={10 * iters}",
           f"--out_dir={out_dir}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    log = subprocess.run(cmd, cwd=nanogpt, env=env, capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    wall = [float(ms) for ms in re.findall(r"^iter \d+: .*time ([\d.]+)ms", log.stdout, re.M)]
    return cpu, wall


def nanogpt_ms(nanogpt: Path, iters: int, out_dir: Path, threads: int) -> tuple[float, list]:
    """(CPU ms per iteration, wall ms of iterations 10 on): the CPU time of a run of 10 + iters
    iterations less that of a run of 10 (start-up, data, the evaluation at iteration 0 cancel)."""
    cpu_short, _ = nanogpt_run(nanogpt, SKIP, out_dir, threads)
    cpu_long, wall = nanogpt_run(nanogpt, SKIP + iters, out_dir, threads)
    return (cpu_long - cpu_short) / iters * 1e3, wall[SKIP:]


def ftrain_ms(step, state, data_dir: Path, iters: int, rows: int, seq: int) -> tuple[float, list]:
    """The same loop in ftrain: a random crop batch as nanoGPT's get_batch reads it, one donated
    step, ``float(loss)`` (nanoGPT's ``loss.item()``). (CPU ms per iteration, wall ms of each),
    over ``iters`` iterations after ``SKIP`` warm-up ones."""
    rng = np.random.default_rng(0)
    wall = []
    for i in range(SKIP + iters):
        if i == SKIP:
            cpu = time.process_time()
        t = time.perf_counter()
        data = np.memmap(data_dir / "train.bin", dtype=np.uint16, mode="r")  # as nanoGPT: anew
        ix = rng.integers(0, len(data) - seq, rows)
        xy = torch.stack([torch.from_numpy(data[i : i + seq + 1].astype(np.int64)) for i in ix])
        state, metrics = step(state, {"input": xy[:, :-1], "target": xy[:, 1:]})
        float(metrics["loss"])  # one host sync per iteration, as nanoGPT's log line
        wall.append((time.perf_counter() - t) * 1e3)
    return (time.process_time() - cpu) / iters * 1e3, wall[SKIP:]


def nanogpt_rows(nanogpt: Path, n_rounds: int, iters: int, threads: int) -> list[str]:
    data_dir, vocab = write_dataset(nanogpt, chars=2_000_000)
    fields = {**MODELS["nanoGPT baby"][0], "vocab_size": vocab}
    rows, seq = MODELS["nanoGPT baby"][1], fields["seq_len"]
    sides = ("auto", "torch", "onednn")
    picked = make_step(fields, rows, "auto")[2].matmul
    cpu = {k: [] for k in ("nanoGPT", *sides)}
    wall = {k: [] for k in cpu}
    out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "ftrain-nanogpt-out"
    for r in range(n_rounds):
        c, w = nanogpt_ms(nanogpt, iters, out_dir, threads)
        cpu["nanoGPT"].append(c)
        wall["nanoGPT"] += w
        for name in sides:  # each run from a new model, as nanoGPT's
            step, state, _ = make_step(fields, rows, name)
            c, w = ftrain_ms(step, state, data_dir, iters, rows, seq)
            cpu[name].append(c)
            wall[name] += w
        print(f"round {r + 1}: CPU ms/iter " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in cpu.items()),
              flush=True)  # fmt: skip
    base_cpu, base_wall = statistics.median(cpu["nanoGPT"]), statistics.median(wall["nanoGPT"])
    out = [f"| nanoGPT train.py | {base_cpu:.2f} | 1.00 | {base_wall:.2f} | 1.00 | |"]
    for name in sides:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        label = f"ftrain, matmul={name!r}" + (f" (picked {picked!r})" if name == "auto" else "")
        met = ("yes" if c / base_cpu <= TARGET else "**no**") if name == "auto" else ""
        out.append(
            f"| {label} | {c:.2f} | {c / base_cpu:.2f} | {w:.2f} | {w / base_wall:.2f} | {met} |"
        )
        print(out[-1], flush=True)
    return out


KERNEL_TEXT = """`python benchmarks/nanogpt_cpu.py{args}`. {machine}; {cpu_id}; load {load:.1f} at the end.

`GPTConfig(matmul="auto")` times oneDNN and torch's own matmul (MKL) once on the model's linear
shapes at the run's batch * seq_len rows (`ftrain.models.choose_matmul`; the answer is cached by
processor, torch version, threads and shapes) and takes oneDNN only where it needs under 0.95 of
torch's time (one thread: timed in CPU time; several threads on a machine with no free core:
torch's, untimed, for such a timing measures the scheduler's slices, not the kernels). One donated AdamW step: CPU ms of this process (judged; waiting for a core does
not inflate it), median of {n} interleaved rounds, and the ratios to torch's matmul in CPU time
and in wall time:

| model | matmul="torch", CPU ms | matmul="onednn" | matmul="auto" | auto picked |
| --- | ---: | ---: | ---: | :---: |
{rows}

The linears alone (`time_linears`, what `auto` measures: forward and both gradients of each
model's linear shapes, each shape's best over 2 s of alternating passes), oneDNN's time over
torch's by rows (batch * seq_len); under 1: oneDNN faster. (Issue 26's numbers from an Intel
Xeon, not this machine: oneDNN forced was 1.11x torch's step at d128/4 layers/seq 128/batch 16,
1.20x on nanoGPT's baby GPT, 1.12x at d512; where oneDNN is that much slower, `auto` takes torch.)

| linears of | {rows_header} |
| --- | {rows_align} |
{linears}
"""
NANOGPT_TEXT = """
nanoGPT's own `train.py` (karpathy/nanoGPT {commit}, the README's CPU flags: 4 layers, 4 heads,
128 wide, block 64, batch 12, dropout 0; character vocabulary of the standard library's ASCII
text, {vocab} symbols) against the same loop in ftrain (random crops of the same `train.bin`, one
donated AdamW step with its schedule, clipping and decay mask, `float(loss)`), {n} alternating
runs of {iters} iterations each after 10 of warm-up. CPU ms per iteration (judged: waiting for a
core does not inflate it): nanoGPT's is the CPU time of a run of 10 + {iters} iterations less that
of a run of 10, over {iters}; ftrain's the process time over the same iterations; median of the
runs. Wall ms per iteration: the median iteration (nanoGPT's from its own log).
Target: ftrain with `matmul="auto"` within {target}x of nanoGPT.

| side | CPU ms / iter | ratio | wall ms / iter | ratio | within {target}x |
| --- | ---: | ---: | ---: | ---: | :---: |
{rows}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, help="a karpathy/nanoGPT checkout: compare with it")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (part 1)")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs (part 2)")
    parser.add_argument("--iters", type=int, default=200, help="iterations per run (part 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--quick", action="store_true", help="a smoke run; nothing written")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = kernel_rows(3 if args.quick else args.rounds, args.quick)
    linears = linears_rows(args.quick)
    flags = f" --threads {args.threads}" + (f" --nanogpt {args.nanogpt}" if args.nanogpt else "")
    body = KERNEL_TEXT.format(args=flags, machine=machine(), load=os.getloadavg()[0],
                              cpu_id=cpu_family_model(),
                              n=args.rounds, rows="\n".join(rows), linears="\n".join(linears),
                              rows_header=" | ".join(f"{r} rows" for r in LINEAR_ROWS),
                              rows_align=" | ".join("---:" for _ in LINEAR_ROWS))  # fmt: skip
    if args.nanogpt is not None:
        iters = 20 if args.quick else args.iters
        n_runs = 1 if args.quick else args.runs
        vs = nanogpt_rows(args.nanogpt.resolve(), n_runs, iters, args.threads)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.nanogpt,
                                capture_output=True, text=True).stdout.strip() or "?"  # fmt: skip
        vocab = pickle.loads((args.nanogpt / "data" / DATASET / "meta.pkl").read_bytes())
        body += NANOGPT_TEXT.format(commit=commit, vocab=vocab["vocab_size"], n=n_runs,
                                    iters=iters, target=TARGET, rows="\n".join(vs))  # fmt: skip
        body += f"\nLoad {os.getloadavg()[0]:.1f} at the end.\n"
    if not args.quick:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
