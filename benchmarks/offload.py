"""ft.offload: one donated AdamW step with the optimizer on the host, against the same step without
offload and against the imperative PyTorch way of offloading.

    python benchmarks/offload.py                  # CPU, a GPT of width 256, 4 blocks; writes RESULTS.md
    python benchmarks/offload.py --device cuda    # on a GPU: what the PCIe copies and host update cost
    python benchmarks/offload.py --quick          # a smoke run at a tiny size, nothing written

Sides, each one training step (forward, backward, AdamW update) of the same GPT on the same batch:

* **ftrain**: ``ft.train_step(loss, adamw, donate=True)``, everything on ``--device``;
* **ftrain offload**: ``ft.offload`` of that step: optimizer state on the host, the update there
  (torch's fused CPU AdamW), the params copied back;
* **ftrain offload+grads per block**: ``ft.offload(step, "optimizer+gradients")``: each
  gradient copied into a host transfer buffer (pinned, reused) during backward, as soon as
  autograd has produced it (on CUDA on a side stream, beside the rest of the backward);
* **ftrain offload+grads after**: the same with the engine's sink dropped (what offload did
  before the per-block copies): the gradients copied to the host after the whole backward;
* **torch offload**: the model on ``--device``, ``loss.backward()``, each ``.grad`` copied into the
  ``.grad`` of a host copy of the params, ``torch.optim.AdamW(fused=True)`` on the host copies,
  then the params copied back (what a hand-written ZeRO-Offload loop does, without overlap).

On a CPU the host is the device: every copy of ``ft.offload`` is a no-op, so the ratio is the
wrapper's own overhead; the torch side still copies (its host params are a second set), and so
does the per-block side (host to host, into its transfer buffers: the same code as on a GPU), so
its ratio to "after" is what those copies cost where nothing is there to overlap them. Timed in
rounds with the order rotating (``_common.rounds``); on CUDA each call ends with a synchronize.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from _common import machine, rounds, write_section  # beside this script

import ftrain as ft
from ftrain.models import GPT, GPTConfig
from ftrain.step import AutogradEngine

LR, WD = 3e-4, 0.1
ON_CPU = (
    "On a CPU the host is the device: ft.offload's copies are no-ops and its ratio is the "
    "wrapper's overhead (the update runs outside any compiled graph, here none); the per-block "
    "side still copies each gradient into its transfer buffer (host to host, nothing to "
    "overlap), so its ratio to 'after' is those copies' cost."
)
ON_GPU = (
    "On a GPU the offloaded sides pay the transfers (gradients and params to the host, params "
    "back) and the host's update; 'per block' copies each gradient on a side stream while the "
    "backward goes on, 'after' once it is done, so their ratio is what the overlap gains (or, "
    "where the backward is too short to hide anything, what the per-gradient hand-over costs)."
)


def sides(device: str, width: int, layers: int, rows: int, seq: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=seq, d_model=width, n_layer=layers, n_head=4))
    model = model.to(device)
    g = torch.Generator().manual_seed(1)
    batch = {
        k: torch.randint(0, 256, (rows, seq), generator=g).to(device) for k in ("input", "target")
    }

    def loss_fn(params, b):
        return ft.losses.cross_entropy(ft.apply(model, params, b["input"]), b["target"])

    opt = ft.optim.adamw(LR, weight_decay=WD)
    step = ft.train_step(loss_fn, opt, donate=True)
    offloaded = ft.offload(step)
    per_block = ft.offload(step, "optimizer+gradients")
    after = WithoutSink()(per_block)  # the copy after backward, as before the sink
    assert per_block.resolved.gradient_engine.sink is not None
    assert after.resolved.gradient_engine.sink is None
    steps = {"ftrain offload+grads per block": per_block, "ftrain offload+grads after": after}
    states = {
        "ftrain": ft.TrainState.create(ft.params_of(model), opt),
        "ftrain offload": offloaded.init_extra(ft.TrainState.create(ft.params_of(model), opt)),
        **{
            k: s.init_extra(ft.TrainState.create(ft.params_of(model), opt))
            for k, s in steps.items()
        },
    }
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def run(name, s):
        def call():
            states[name], _ = s(states[name], batch)
            sync()

        return call

    host = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    torch_opt = torch.optim.AdamW(host, lr=LR, weight_decay=WD, fused=True)

    def torch_offload():
        out = model(batch["input"])
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), batch["target"].flatten())
        loss.backward()
        for h, p in zip(host, model.parameters()):
            h.grad = p.grad.to("cpu")  # a device-to-host copy, synchronous
            p.grad = None
        torch_opt.step()
        with torch.no_grad():
            for h, p in zip(host, model.parameters()):
                p.copy_(h, non_blocking=True)
        sync()

    return {"ftrain": run("ftrain", step), "ftrain offload": run("ftrain offload", offloaded),
            **{k: run(k, s) for k, s in steps.items()},
            "torch offload": torch_offload}  # fmt: skip


class WithoutSink(ft.Transform):
    """The default gradient engine back, without ft.offload's sink: the gradients are then
    copied to the host by offload's gradients hook, after the whole backward."""

    def engine(self, engine):
        return AutogradEngine(engine.reduced_in_backward, engine.reduced_after)


def profile_sides(fns: dict, out: str, device: str) -> None:
    """One step of each ft.offload side under torch.profiler; the whole table (by device time
    on CUDA, host time on the CPU) in ``out/offload_<side>.txt``."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out, exist_ok=True)
    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name, fn in fns.items():
        if not name.startswith("ftrain offload"):
            continue
        fn()  # warm
        with profile(activities=acts) as prof:
            fn()
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=70)
        path = os.path.join(
            out, "offload_" + name.removeprefix("ftrain ").replace(" ", "_") + ".txt"
        )
        with open(path, "w") as f:
            f.write(table)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: see step_overhead.py)"
    )
    ap.add_argument(
        "--large", action="store_true",
        help="a GPT of width 1024, 8 blocks, 8 rows of 512 tokens (101M params): on a GPU, a "
        "backward long enough for the gradients' copies to hide behind",
    )  # fmt: skip
    ap.add_argument(
        "--profile", default=None, metavar="DIR",
        help="after timing, write the profiler's table of one step of each ft.offload side there",
    )  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    size = (64, 2, 4, 32) if args.quick else (256, 4, 8, 128)  # width, blocks, rows, seq_len
    size = (1024, 8, 8, 512) if args.large else size
    fns = sides(args.device, *size)
    n = 3 if args.quick else args.rounds
    got = rounds(fns, n)
    if args.profile:  # last: a process the profiler has run in launches kernels more slowly
        profile_sides(fns, args.profile, args.device)
    base = got["ftrain"]["wall"]
    rows = [f"| {k} | {v['wall'] * 1e3:.1f} | {v['wall'] / base:.2f}x |" for k, v in got.items()]
    per_block = got["ftrain offload+grads per block"]["wall"]
    ratio = per_block / got["ftrain offload+grads after"]["wall"]
    load = os.getloadavg()[0]
    body = "\n".join(
        [
            f"`python benchmarks/offload.py --device {args.device}{' --large' if args.large else ''}"
            f"{f' --threads {args.threads}' if args.threads != 1 else ''}` on {machine()}; load average "
            f"{load:.1f} while it ran. A GPT of width {size[0]}, {size[1]} blocks, {size[2]} rows "
            f"of {size[3]} tokens; one donated AdamW step, median of {n} rounds.",
            "",
            "| side | ms per step | vs ftrain |",
            "| --- | --- | --- |",
            *rows,
            "",
            f"Gradients copied per block during backward vs after it: {ratio:.2f}x the step time.",
            "",
            ON_CPU if args.device == "cpu" else ON_GPU,
        ]
    )
    print(body)
    if not args.quick:
        write_section(f"Offload ({args.device}{', large' if args.large else ''})", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
