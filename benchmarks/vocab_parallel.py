"""Memory of the vocabulary-parallel cross-entropy per rank against the loss on whole logits.

    python benchmarks/vocab_parallel.py            # tokens 2048, vocabulary 50304 (GPT-2's, padded)
    python benchmarks/vocab_parallel.py --tokens 512 --vocab 8192

Bytes are exact, not timed: ``ftrain.testing.track_allocations`` counts every storage the loss's
forward and backward allocate (the logits themselves are made before, so they are listed apart).
The whole-logits loss is ``ft.losses.cross_entropy`` on one process; the vocabulary-parallel one
is ``ft.distributed.vocab_parallel_cross_entropy`` on ``tp`` gloo ranks, each holding ``1 / tp``
of the vocabulary (the output of a column-parallel ``lm_head``). Gathering the logits instead
would cost every rank the whole-logits row plus the gathered logits. Prints a Markdown table for
RESULTS.md, and the wall time of one forward and backward (CPU, gloo: a sanity figure only).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

import ftrain as ft
from ftrain.distributed import run_distributed, vocab_parallel_cross_entropy
from ftrain.testing import track_allocations

MB = 2**20


def logits_and_targets(tokens: int, vocab: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(tokens, vocab, generator=g) * 2).to(dtype)  # (N, V)
    return logits, torch.randint(0, vocab, (tokens,), generator=g)


def measure(loss_of, logits: torch.Tensor) -> tuple[float, int, float]:
    """(loss value, peak bytes allocated by forward + backward, seconds) for ``logits``."""
    logits = logits.clone().requires_grad_()
    t = time.perf_counter()
    with track_allocations() as mem:
        loss = loss_of(logits).value
        loss.backward()
    return float(loss.detach()), mem.peak, time.perf_counter() - t


def rank_fn(tokens: int, vocab: int, dtype: torch.dtype):
    import torch.distributed as dist

    logits, targets = logits_and_targets(tokens, vocab, dtype)
    piece = logits.chunk(dist.get_world_size(), dim=-1)[dist.get_rank()].clone()  # (N, V / tp)
    del logits
    return measure(lambda x: vocab_parallel_cross_entropy(x, targets), piece)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        logits, targets = logits_and_targets(args.tokens, args.vocab, dtype)
        size = dtype.itemsize
        value, peak, secs = measure(
            functools.partial(ft.losses.cross_entropy, targets=targets), logits
        )
        del logits
        whole = args.tokens * args.vocab * size
        name = str(dtype).removeprefix("torch.")
        rows.append(f"| {name} | whole (1 process) | {whole / MB:,.1f} | {peak / MB:,.1f} | 1.00 |")
        for tp in args.tp:
            results = run_distributed(rank_fn, tp, args.tokens, args.vocab, dtype)
            worst = max(r[1] for r in results)
            assert all(abs(r[0] - value) <= 1e-4 * abs(value) for r in results), (value, results)
            rows.append(
                f"| {name} | vocab-parallel tp={tp} | {whole / tp / MB:,.1f} | {worst / MB:,.1f} "
                f"| {worst / peak:.2f} |"
            )
            secs_tp = max(r[2] for r in results)
            print(f"{name} tp={tp}: {secs_tp:.2f} s per forward+backward (whole: {secs:.2f} s)")
    print(
        f"\n`python benchmarks/vocab_parallel.py`: {args.tokens} tokens, vocabulary "
        f"{args.vocab}; bytes per rank from `track_allocations` (exact).\n\n"
        "| logits | layout | logits MB / rank | loss fwd+bwd peak MB / rank | / whole |\n"
        "| --- | --- | ---: | ---: | ---: |\n" + "\n".join(rows)
    )


if __name__ == "__main__":
    main()
