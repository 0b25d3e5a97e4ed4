"""Activation bytes a transformer block keeps for backward, per rank: one process, tensor parallel
(TP), and tensor + sequence parallel (TP + SP); then the same for a whole ``ft.tensor_parallel``
training step of a GPT, with and without ``sequence_parallel=True``.

    PYTHONPATH=. python benchmarks/sequence_parallel.py      # B 4, T 512, C 512, 8 heads
    PYTHONPATH=. python benchmarks/sequence_parallel.py --tp 2 --seq 256 --skip-block

The block is GPT's: LayerNorm -> qkv (columns) -> causal attention -> proj (rows) -> dropout ->
residual, LayerNorm -> fc (columns) -> GELU -> proj (rows) -> dropout -> residual, fp32. Under TP
(``ftrain.distributed.tensor_parallel.linear``) the activations inside each column/row pair are
split by heads or features, but the norms, dropout and residuals between the pairs run on whole
activations on every rank; under SP (``ftrain.distributed.tensor_parallel.sequence``) those are
split along the sequence too. Bytes are exact: ``ftrain.testing.saved_bytes`` of the block's forward
(what autograd keeps, plus the output). The step table uses
``ftrain.testing.saved_activation_bytes`` of the whole step's forward (embeddings, ``--layers``
blocks, the final norm, the whole logits and the loss; dropout 0, which ``sequence_parallel``
requires). Prints Markdown tables for RESULTS.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from ftrain.distributed import run_distributed
from ftrain.testing import saved_bytes

MB = 2**20
DROPOUT = 0.1


def make(batch: int, seq: int, width: int):
    g = torch.Generator().manual_seed(0)
    shapes = {"qkv": (3 * width, width), "proj": (width, width)}
    shapes |= {"fc": (4 * width, width), "out": (width, 4 * width)}
    params = {k: torch.randn(s, generator=g) * s[1] ** -0.5 for k, s in shapes.items()}
    params |= {f"{k}.b": torch.zeros(s[0]) for k, s in shapes.items()}
    params |= {f"ln{i}.{w}": torch.ones(width) for i in (1, 2) for w in "wb"}
    return params, torch.randn(batch, seq, width, generator=g)  # x: (B, T, C)


def block(p, x, heads, linear_in, linear_out, dropout):
    """The block on whatever pieces ``linear_in`` / ``linear_out`` and ``x`` hold."""
    width = x.shape[-1]
    h = F.layer_norm(x, (width,), p["ln1.w"], p["ln1.b"])
    q, k, v = linear_in(h, p["qkv"], p["qkv.b"]).chunk(3, dim=-1)  # (B, T, C / tp) each
    q, k, v = (t.unflatten(-1, (-1, width // heads)).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads / tp, T, hd)
    x = x + dropout(linear_out(y.transpose(1, 2).flatten(2), p["proj"], p["proj.b"]), 1)
    h = F.layer_norm(x, (width,), p["ln2.w"], p["ln2.b"])
    m = linear_out(F.gelu(linear_in(h, p["fc"], p["fc.b"])), p["out"], p["out.b"])
    return x + dropout(m, 2)


def rank_fn(batch: int, seq: int, width: int, heads: int, sequence: bool) -> int:
    import torch.distributed as dist

    from ftrain.distributed.tensor_parallel import linear as tp
    from ftrain.distributed.tensor_parallel import sequence as sp
    from ftrain.distributed.tensor_parallel.plans import Split, local_piece

    rank, size = dist.get_rank(), dist.get_world_size()
    params, x = make(batch, seq, width)
    splits = {"qkv": Split(0, 3), "qkv.b": Split(0, 3), "fc": Split(0), "fc.b": Split(0)}
    splits |= {"proj": Split(1), "out": Split(1)}
    p = {
        k: local_piece(v, splits.get(k, Split(None)), rank, size).clone().requires_grad_()
        for k, v in params.items()
    }
    if sequence:
        x = x.chunk(size, dim=1)[rank].clone()  # (B, T / tp, C)
        offset = rank * x.shape[1]
        lin_in = lambda h, w, b: sp.colwise_linear_sp(h, w, b, None)  # noqa: E731
        lin_out = lambda h, w, b: sp.rowwise_linear_sp(h, w, b, None)  # noqa: E731
    else:
        offset = 0
        lin_in = lambda h, w, b: tp.colwise_linear(h, w, b, None)  # noqa: E731
        lin_out = lambda h, w, b: tp.rowwise_linear(h, w, b, None)  # noqa: E731

    def drop(t, key):
        return sp.sequence_dropout(t, DROPOUT, key, offset=offset)

    return saved_bytes(block, p, x.requires_grad_(), heads, lin_in, lin_out, drop)


def _gpt(batch: int, seq: int, width: int, heads: int, layers: int, vocab: int):
    import ftrain as ft
    from ftrain.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=vocab, seq_len=seq, d_model=width, n_layer=layers, n_head=heads)
    )
    opt = ft.optim.sgd(0.1)

    def loss_fn(params, batch):
        logits = ft.apply(model, params, batch["input"])  # (B, T, V)
        return ft.losses.cross_entropy(logits, batch["target"])

    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input": tokens, "target": tokens.roll(-1, 1)}
    return model, ft.train_step(loss_fn, opt), ft.TrainState.create(ft.params_of(model), opt), batch


def step_rank_fn(sizes: tuple, tp_size: int, sequence: bool) -> int:
    """Bytes the whole tensor-parallel step keeps for backward on this rank."""
    import ftrain as ft
    from ftrain.distributed.tensor_parallel.plans import gpt_plan
    from ftrain.testing import saved_activation_bytes

    model, step, state, batch = _gpt(*sizes)
    tp = ft.tensor_parallel(
        model, gpt_plan(), ft.distributed.tp_mesh(tp_size), sequence_parallel=sequence
    )
    return saved_activation_bytes(tp(step), tp.shard_state(state), batch)


def step_table(a) -> str:
    from ftrain.testing import saved_activation_bytes

    sizes = (a.batch, a.seq, a.width, a.heads, a.layers, a.vocab)
    _, step, state, batch = _gpt(*sizes)
    whole = saved_activation_bytes(step, state, batch)
    rows = [f"| one process | 1 | {whole / MB:,.1f} | 1.00 | |"]
    for size in a.tp:
        tp_bytes = None
        for sequence, name in ((False, "ft.tensor_parallel"), (True, "+ sequence_parallel")):
            worst = max(run_distributed(step_rank_fn, size, sizes, size, sequence))
            vs = f"{worst / tp_bytes:.2f}" if tp_bytes else ""
            tp_bytes = tp_bytes or worst
            rows.append(f"| {name} | {size} | {worst / MB:,.1f} | {worst / whole:.2f} | {vs} |")
    return (
        f"Whole training step (`ft.testing.saved_activation_bytes`): GPT, B={a.batch}, "
        f"T={a.seq}, C={a.width}, {a.heads} heads, {a.layers} blocks, vocabulary {a.vocab}, "
        "fp32, dropout 0; bytes kept for backward per rank.\n\n"
        "| step | tp | saved MB / rank | / one process | / TP |\n"
        "| --- | ---: | ---: | ---: | ---: |\n" + "\n".join(rows)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=4, help="blocks of the whole-step GPT")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary of the whole-step GPT")
    parser.add_argument("--skip-block", action="store_true", help="only the whole-step table")
    a = parser.parse_args()
    if a.skip_block:
        print(step_table(a))
        return
    from ftrain.distributed.tensor_parallel.sequence import sequence_dropout

    params, x = make(a.batch, a.seq, a.width)
    params = {k: v.requires_grad_() for k, v in params.items()}
    whole = saved_bytes(
        block,
        params,
        x.requires_grad_(),
        a.heads,
        F.linear,
        F.linear,
        lambda t, key: sequence_dropout(t, DROPOUT, key),
    )
    rows = [f"| one process | 1 | {whole / MB:,.1f} | 1.00 |"]
    for size in a.tp:
        for sequence, name in ((False, "TP"), (True, "TP + SP")):
            args = (a.batch, a.seq, a.width, a.heads, sequence)
            worst = max(run_distributed(rank_fn, size, *args))
            rows.append(f"| {name} | {size} | {worst / MB:,.1f} | {worst / whole:.2f} |")
    print(
        f"`python benchmarks/sequence_parallel.py`: one GPT block, B={a.batch}, T={a.seq}, "
        f"C={a.width}, {a.heads} heads, fp32, dropout {DROPOUT}; bytes kept for backward per "
        "rank from `saved_bytes` (exact).\n\n"
        "| layout | tp | saved MB / rank | / one process |\n| --- | ---: | ---: | ---: |\n"
        + "\n".join(rows)
    )
    print()
    print(step_table(a))


if __name__ == "__main__":
    main()
