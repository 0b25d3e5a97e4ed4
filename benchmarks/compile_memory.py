"""Peak memory of the compiled step on the CPU: ftrain's ``ft.compile`` beside ``torch.compile``
of the model in nanoGPT's imperative loop, the sides of ``benchmarks/gpu.py`` at a small size.

    python benchmarks/compile_memory.py     # about 10 minutes on 2 cores (bf16 matmuls are slow
                                            # on CPUs without bf16 units); writes RESULTS.md

A GPT of GPT-2's vocabulary shape at a small width (vocab 8192, d=256, 4 heads, 4 blocks, seq 256,
batch 4), bf16 autocast, AdamW; each side compiled, run three times, then one step measured with
``ftrain.testing.allocator_peak`` (the CPU allocator's peak over the step, above what was held
before it: the compiled code's buffers and kernels' scratch included). The column "at peak" lists
the largest buffers alive at that moment (MiB x count): the logits are 1024 x 8192, 16 MiB in bf16.
This is where a difference in the compiled graph's memory can be found without a GPU; the GPU's
own numbers come from ``benchmarks/gpu.py``.
"""

from __future__ import annotations

import collections

import gpu  # its sides: ftrain's step and the imperative loop (this folder is on the path)
import torch
from _common import machine, write_section

import ftrain as ft
from ftrain.internals import dynamo

DIMS = dict(gpu.BENCH, vocab_size=8192, d_model=256, n_head=4, n_layer=4, seq_len=256)
ROWS = 4
SIDES = {
    "PyTorch loop (torch.compile of the model)": gpu.torch_side,
    "ftrain (ft.compile of the step)": gpu.ftrain_side,
    "ftrain, loss in bf16 as the loop's": gpu.ftrain_bf16_loss_side,
}


def main() -> None:
    run = gpu.Run(torch.device("cpu"), tiny=False, compile=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, DIMS["vocab_size"], (ROWS, DIMS["seq_len"]), generator=g)
    y = torch.randint(0, DIMS["vocab_size"], (ROWS, DIMS["seq_len"]), generator=g)
    rows = []
    for name, side in SIDES.items():
        one, _ = side(run, DIMS, x, y, True)
        one()
        sizes: list[int] = []
        peak = ft.testing.allocator_peak(one, buffers=sizes)
        counts = collections.Counter(round(size / 2**20, 1) for size in sizes)
        largest = sorted(counts.items(), reverse=True)[:5]
        rows.append((name, peak, ", ".join(f"{mib:g} x {n}" for mib, n in largest)))
        print(f"{name}: {peak / 2**20:.1f} MiB", flush=True)
    loop = rows[0][1]
    one_graph = dynamo.traces_whole_steps()
    body = "\n".join(
        [
            f"`python benchmarks/compile_memory.py` on {machine()}. ft.compile here: "
            + (
                "the whole step as one graph (dynamo traces the backward)."
                if one_graph
                else "the backward compiled apart (dynamo cannot trace the whole step)."
            ),
            "",
            "| side | peak MiB | / loop | largest alive at the peak, MiB x count |",
            "| --- | ---: | ---: | --- |",
            *[f"| {n} | {p / 2**20:.1f} | {p / loop:.2f} | {a} |" for n, p, a in rows],
        ]
    )
    version = ".".join(torch.__version__.split(".")[:2])
    # "Before the fixes" is written by hand: the same sides measured before ft.compile and the
    # bf16 loss changed, kept when the table is rewritten
    write_section(f"Compiled peak memory on the CPU (torch {version})", body, keep=("Before",))
    print(body)


if __name__ == "__main__":
    main()
