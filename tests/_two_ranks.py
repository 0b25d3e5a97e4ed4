"""The one 2-rank run of the suite: every ``ft.shard`` check that needs processes, in one call.

Starting processes that import torch costs seconds, so ``conftest.py``'s session fixture
``two_ranks`` runs :func:`on_two_ranks` once, on 2 gloo processes, and the tests of
``test_transforms_shard.py``, ``test_distributed_zero.py``, ``test_distributed_fsdp.py``,
``test_distributed_launch.py``, ``test_distributed_owners.py`` and ``test_optim_muon.py`` read
what it returns and compare it, in the parent, against single-process references. The setting below is the same in the parent and in the ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import ftrain as ft
from ftrain import tree
from ftrain.distributed import (
    STRATEGIES,
    default_mesh,
    init,
    local_bytes,
    rank_and_world,
    shard_state,
    track_gathered,
    unshard_state,
)
from ftrain.distributed.collectives import as_sharded
from ftrain.distributed.data_parallel.owners import on_owners
from ftrain.distributed.dtensor import dtensor
from ftrain.transforms import StaticLossScale, shard

from _tiny import lm_batch, lm_loss, tiny_gpt

WORLD = 2
ROWS = 4  # global batch; each rank gets ROWS // WORLD rows
STEPS = 3
LENGTH = 8
# rank 0's rows hold far fewer valid tokens than rank 1's: a mean of per-rank means would be wrong
LENGTHS = (2, 5, LENGTH, LENGTH)


# ddp/zero1/zero2 reduce in buckets of this many MiB during backward (section 1): about 20 KB,
# so the tiny GPT's 110 KB of gradients go in 7 buckets (a 16 KB matrix alone, biases together)
BUCKET_MB = 0.02


def gpt(n_layer=2, **kw):
    return tiny_gpt(seq_len=LENGTH, n_head=2, n_layer=n_layer, **kw)


def batches(steps=STEPS) -> list[dict[str, torch.Tensor]]:
    return [lm_batch(ROWS, seed=100 + i, lengths=LENGTHS, length=LENGTH) for i in range(steps)]


def rows_of(batch, rank):
    per = ROWS // WORLD
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}


def sgd():
    return ft.optim.sgd(0.5, momentum=0.9)


def adamw():
    return ft.optim.chain(
        ft.optim.clip_by_global_norm(0.5),
        ft.optim.adamw(1e-3, weight_decay=0.1, mask=ft.optim.decay_mask),
    )


def adafactor():
    return ft.optim.adafactor(1e-2, weight_decay=0.1)


def muon():
    # fused=False: sharded (DTensor) leaves always run AdamW's foreach chain, so every strategy,
    # ddp included, compares the same kernels (torch's fused one rounds differently)
    return ft.optim.muon_adamw(0.02, weight_decay=0.1, mask=ft.optim.decay_mask, fused=False)


# on_owners' inputs: row-sharded tensors of mixed shapes and dtypes (rank 1 holds no row of the
# 1-row one), then a plain tensor and a column-sharded DTensor (computed on every rank)
OWNED_SHAPES = [(5, 3), (1, 4), (33, 8), (5, 3), (3, 2, 2), (6,)]
OWNED_F64 = 3  # this one is float64: it travels in an exchange of its own
OTHER_SHAPES = [(4, 4), (5, 7)]


def owned_inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    ts = [torch.randn(s, generator=g) for s in OWNED_SHAPES + OTHER_SHAPES]
    ts[OWNED_F64] = ts[OWNED_F64].double()
    return ts


def whole_fn(t: torch.Tensor) -> torch.Tensor:
    """A function of every row of ``t`` (each row of the result depends on all of them)."""
    return t.cumsum(0) * t.sum() + t.flip(0)


def composed(step, micro_batches):
    return ft.accumulate(ft.checkpoint(ft.autocast(step, torch.bfloat16)), micro_batches)


OPTIMIZERS = {
    "lion": lambda: ft.optim.lion(1e-4, weight_decay=0.1),
    "lamb": lambda: ft.optim.lamb(1e-3),
    "adamw8bit": lambda: ft.optim.adamw8bit(1e-3),
    "schedule_free_adamw": lambda: ft.optim.schedule_free_adamw(1e-3, 1, weight_decay=0.1),
}

CONFIGS = {
    # name: (optimizer, model options, transforms on the sharded step, on the 1-process step)
    "sgd": (sgd, {}, lambda s: s, lambda s: s),
    "composed": (sgd, {}, lambda s: composed(s, 2), lambda s: composed(s, 4)),
    # bias=False: the key bias of attention has a zero gradient in exact arithmetic, which
    # Adam would turn into rounding noise of the size of the learning rate.
    "adamw": (adamw, {"bias": False}, lambda s: s, lambda s: s),
    # factored second moments: a matrix's column statistic is a mean over every process's rows
    "adafactor": (adafactor, {"bias": False}, lambda s: s, lambda s: s),
    "adafactor, donated": (adafactor, {"bias": False}, lambda s: s, lambda s: s),
}
DONATED = ("adamw", "adafactor, donated")  # in place, as the CLI runs them
# an odd vocabulary: the embedding's rows split unevenly over 2 ranks, so zero2's bucket copies
# it rank by rank, and every other gradient in one strided copy
BUCKETS_FP16 = (
    sgd,
    {"vocab_size": 65},
    lambda s: ft.accumulate(ft.autocast(s, torch.float16), 2),
    None,
)

# fsdp with and without prefetch (section 2b): each changes when and in what order it gathers
PREFETCH_CONFIGS = {
    "plain": lambda s: s,
    "checkpoint": ft.checkpoint,  # the recompute's gathers prefetched in backward
    "selective": lambda s: ft.checkpoint(s, "selective"),  # its blocks' gathers stay blocking
    "accumulate": lambda s: ft.accumulate(s, 2),  # two backwards per step
    "composed": lambda s: composed(s, 2),
    "fp16": lambda s: ft.autocast(s, torch.float16),  # Partial gradients: reduced after backward
}

# ft.dp_sgd under shard: the noise's bound and multiplier (clipped examples and noise both matter)
DP_CLIP, DP_NOISE = 0.05, 1.0


def dp_model():
    return gpt(bias=False)


RESUMED = [("adamw", "zero2"), ("adamw", "fsdp"), ("adafactor", "zero1"), ("adafactor", "fsdp")]


def vmap_members(opt, k=2):
    """``k`` states of ``gpt(bias=False)`` with different initial params and seeds."""
    return [
        ft.TrainState.create(ft.params_of(gpt(bias=False, seed=i)), opt, seed=7 + i)
        for i in range(k)
    ]


def lora_setup(make_opt):
    """ft.lora on ``gpt(bias=False)``: ``(model, lora, step, state)`` (test_transforms_lora.py)."""
    model = gpt(bias=False)
    lora = ft.lora(model, rank=2, alpha=4.0, targets=["attn.qkv", "mlp.fc"])
    step = lora(ft.train_step(lm_loss(model), make_opt()))
    return model, lora, step, lora.init_state(ft.params_of(model), make_opt(), seed=0)


def run(step, state, data, rank=None):
    for b in data:
        state, metrics = step(state, b if rank is None else rows_of(b, rank))
    return state, metrics


def whole(state):
    return {"params": tree.to_flat(state.params), "opt_state": tree.to_flat(state.opt_state)}


def layouts(td) -> set[str]:
    """How the tensors of ``td`` with one or more dims are laid out: "plain" or placements."""
    return {
        repr(tuple(t.placements)) if hasattr(t, "placements") else "plain"
        for t in tree.leaves(td)
        if t.dim() > 0
    }


def on_two_ranks(tmp: str) -> dict:
    """What one rank does; returns what the tests compare."""
    rank = dist.get_rank()
    out: dict = {"rank": rank, "tmp": tmp}
    data = batches()

    # 0. the launch: the group exists, init() finds it
    out["rank_and_world"] = rank_and_world()
    out["init"] = init()

    # 1. every strategy, every config: STEPS steps on this rank's rows
    for name, (make_opt, model_kw, transform, _) in CONFIGS.items():
        for strategy in STRATEGIES:
            model, opt = gpt(**model_kw), make_opt()
            step = shard(
                transform(ft.train_step(lm_loss(model), opt, donate=name in DONATED)),
                strategy,
                bucket_mb=BUCKET_MB,
            )
            state = shard_state(ft.TrainState.create(ft.params_of(model), opt), strategy)
            state, metrics = run(step, state, data, rank)
            out[name, strategy] = {
                "layouts": layouts(state.opt_state),
                **whole(unshard_state(state)),
                "metrics": {k: v.clone() for k, v in metrics.items()},
                "param_bytes": local_bytes(state.params),
                "opt_bytes": local_bytes(state.opt_state),
                "plain_metrics": all(type(v) is torch.Tensor for v in metrics.values()),
            }

    # 1b. the buckets reduced during backward (section 1) against one reduction after backward,
    # and with ft.offload's host copies chained after the buckets (offload inside or outside);
    # "fp16": 2 micro-batches under a dynamic loss scale, each reweighted by its count as handed
    for name in ("composed", "adamw", "fp16"):
        make_opt, model_kw, transform, _ = CONFIGS.get(name) or BUCKETS_FP16
        for strategy in ("ddp", "zero1", "zero2"):
            runs = {}
            alone = ("buckets",) if name == "fp16" else ()  # the others': section 1
            for variant in ("after backward", "offload inside", "offload outside", *alone):
                model, opt = gpt(**model_kw), make_opt()
                step = ft.train_step(lm_loss(model), opt, donate=name in DONATED)
                if variant == "offload inside":
                    step = ft.offload(step, "optimizer+gradients")
                bucket = None if variant == "after backward" else BUCKET_MB
                step = shard(transform(step), strategy, bucket_mb=bucket)
                if variant == "offload outside":
                    step = ft.offload(step, "optimizer+gradients")
                state = step.init_extra(ft.TrainState.create(ft.params_of(model), opt))
                state, metrics = run(step, shard_state(state, strategy), data, rank)
                sink = getattr(step.resolved.gradient_engine, "sink", None)
                runs[variant] = {
                    **whole(unshard_state(state)),
                    "metrics": {k: v.clone() for k, v in metrics.items()},
                    "host copies": len(getattr(sink, "buffers", ())),
                }
            out["buckets", name, strategy] = runs

    # 2. fsdp holds whole params one block at a time (4 blocks), with and without checkpoint;
    # with prefetch (the default) the next block's gather buffer too
    for name, transform in (("fsdp", lambda s: s), ("fsdp+checkpoint", ft.checkpoint)):
        for prefetch in (False, True):
            model = gpt(n_layer=4)
            step = shard(transform(ft.train_step(lm_loss(model), sgd())), "fsdp", prefetch=prefetch)
            state = shard_state(ft.TrainState.create(ft.params_of(model), sgd()), "fsdp")
            state, _ = step(state, rows_of(data[0], rank))  # warm up
            with track_gathered() as t:
                state, _ = step(state, rows_of(data[1], rank))
            out["peak", name, prefetch] = (t.peak, t.gathers)

    # 2b. fsdp's prefetch (async collectives started one block early) against the blocking
    # gathers: the same bits, composed with what changes the order of its collectives
    for name, transform in PREFETCH_CONFIGS.items():
        runs = []
        for prefetch in (False, True):
            model = gpt(n_layer=3)
            step = shard(
                transform(ft.train_step(lm_loss(model), adamw())), "fsdp", prefetch=prefetch
            )
            state = step.init_extra(ft.TrainState.create(ft.params_of(model), adamw()))
            state, metrics = run(step, shard_state(state, "fsdp"), data, rank)
            runs.append({**whole(unshard_state(state)), "loss": metrics["loss"].clone()})
        out["prefetch", name] = runs

    # 3. save (whole, from rank 0) after 2 steps, load on every rank, 1 more step
    for name, strategy in RESUMED:
        model, make_opt = gpt(), {"adamw": adamw, "adafactor": adafactor}[name]
        step = shard(ft.train_step(lm_loss(model), make_opt()), strategy)
        state = shard_state(ft.TrainState.create(ft.params_of(model), make_opt()), strategy)
        state, _ = run(step, state, data[:2], rank)
        path = f"{tmp}/{name}-{strategy}"
        saved = unshard_state(state)
        if rank == 0:
            ft.save(saved, path)
        dist.barrier()
        resumed = shard_state(ft.load(path, like=saved), strategy)
        resumed, _ = run(step, resumed, data[2:], rank)
        straight, _ = run(step, state, data[2:], rank)
        out["resume", name, strategy] = (
            whole(unshard_state(resumed)),
            whole(unshard_state(straight)),
        )

    # 4. more optimizers: the math on shards against the same math under ddp
    for name, make_opt in OPTIMIZERS.items():
        for strategy in STRATEGIES:
            model, opt = gpt(bias=False), make_opt()
            step = shard(ft.train_step(lm_loss(model), opt), strategy)
            state = shard_state(ft.TrainState.create(ft.params_of(model), opt), strategy)
            state, _ = run(step, state, data[:2], rank)
            out["optimizer", name, strategy] = whole(unshard_state(state))

    # 5. muon_adamw: Newton-Schulz needs whole matrices (mlp.fc's 33 rows split 17/16)
    for strategy in STRATEGIES:
        model, opt = gpt(d_ff=33), muon()
        step = shard(ft.train_step(lm_loss(model), opt), strategy)
        state = shard_state(ft.TrainState.create(ft.params_of(model), opt), strategy)
        state, _ = run(step, state, data, rank)
        out["muon", strategy] = {"layouts": layouts(state.opt_state), **whole(unshard_state(state))}
    # other layouts than ft.shard's (columns split, replicated): Newton-Schulz of the whole matrix
    d = dtensor()
    mesh = default_mesh()
    g = torch.randn(5, 7, generator=torch.Generator().manual_seed(3))
    ortho = ft.optim.orthogonalize()
    for placement in (d.Shard(1), d.Replicate()):
        u = tree.from_flat({"w": d.distribute_tensor(g, mesh, [placement])})
        got = ortho.update(u, ortho.init(u))[0]["w"]
        out["muon", str(placement)] = (got.placements, got.full_tensor())

    # on_owners itself: each rank records the shapes its fn computed
    wholes, seen = owned_inputs(), []
    n = len(OWNED_SHAPES)
    ins = [as_sharded(t, mesh, copy=True) for t in wholes[:n]]
    ins += [wholes[n], d.distribute_tensor(wholes[n + 1], mesh, [d.Shard(1)])]

    def fn(ts):
        seen.extend(tuple(t.shape) for t in ts)
        return [whole_fn(t) for t in ts]

    got = on_owners(fn, ins)
    out["on_owners"] = {
        "placements": [str(t.placements) if hasattr(t, "placements") else "plain" for t in got],
        "whole": [t.full_tensor() if hasattr(t, "placements") else t for t in got],
        "seen": seen,
    }

    # 6. fp16 loss scaling: the same as ddp; an overflow is skipped on every rank
    for strategy in STRATEGIES:
        model = gpt()
        step = shard(ft.autocast(ft.train_step(lm_loss(model), sgd()), torch.float16), strategy)
        state = step.init_extra(ft.TrainState.create(ft.params_of(model), sgd()))
        state, _ = run(step, shard_state(state, strategy), data, rank)
        huge = StaticLossScale(1e30)
        step = shard(
            ft.autocast(ft.train_step(lm_loss(model), sgd()), torch.float16, loss_scale=huge),
            strategy,
        )
        before = shard_state(
            step.init_extra(ft.TrainState.create(ft.params_of(model), sgd())), strategy
        )
        after, metrics = step(before, rows_of(data[0], rank))
        out["fp16", strategy] = (
            whole(unshard_state(state)),
            bool(metrics["skipped"]),
            whole(unshard_state(before)),
            whole(unshard_state(after)),
        )

    # 7. ft.vmap under ddp: members replicated, the batch split (test_transforms_vmap.py)
    model = gpt(bias=False)
    step = shard(ft.vmap(ft.train_step(lm_loss(model), adamw())), "ddp")
    state = shard_state(ft.stack(vmap_members(adamw())), "ddp")
    state, metrics = run(step, state, data, rank)
    out["vmap"] = (whole(state), {k: v.clone() for k, v in metrics.items()})

    # 8. mistakes that are caught
    errors = {}
    model = gpt()
    plain = ft.TrainState.create(ft.params_of(model), sgd())
    step = shard(ft.train_step(lm_loss(model), sgd()), "fsdp")
    try:
        step(plain, rows_of(data[0], rank))
    except ValueError as e:
        errors["unsharded state"] = str(e)
    skewed = plain.replace(params=plain.params.apply(lambda t: t + rank))
    try:
        shard_state(skewed, "zero1")
    except ValueError as e:
        errors["params differ"] = str(e)
    try:
        ft.compile(shard(ft.train_step(lm_loss(model), sgd()), "fsdp"))
    except ValueError as e:
        errors["compile after fsdp"] = str(e)
    for strategy in ("ddp", "zero1", "zero2"):  # these compile (built here, not run)
        ft.compile(shard(ft.train_step(lm_loss(model), sgd()), strategy))
    out["errors"] = errors

    # 9. ft.dp_sgd: the noise is drawn alike on every rank and added once, after the reduction
    for strategy in ("ddp", "zero2"):
        model = dp_model()
        opt = ft.optim.sgd(1.0)
        step = shard(ft.dp_sgd(ft.train_step(lm_loss(model), opt), DP_CLIP, DP_NOISE), strategy)
        state = shard_state(ft.TrainState.create(ft.params_of(model), opt), strategy)
        state, metrics = run(step, state, data, rank)
        out["dp_sgd", strategy] = {
            "params": whole(unshard_state(state))["params"],
            "count": int(metrics["count"]),
            "noise_std": metrics["noise_std"].clone(),
        }
    try:
        shard(ft.dp_sgd(ft.train_step(lm_loss(model), sgd()), DP_CLIP, DP_NOISE), "fsdp")
    except ValueError as e:
        errors["dp_sgd with fsdp"] = str(e)

    # 10. ft.lora: the adapters trained, the frozen base in state.extra (test_transforms_lora.py)
    for strategy in STRATEGIES:
        _, _, step, state = lora_setup(sgd)
        state, _ = run(shard(step, strategy), shard_state(state, strategy), data, rank)
        out["lora", strategy] = whole(unshard_state(state))
    return out
