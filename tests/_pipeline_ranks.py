"""The pipeline runs of the suite: every ``ft.pipeline`` check that needs processes, in one call
per process count.

``conftest.py``'s session fixtures run :func:`on_two_ranks` (pp = 2) and, in the slow tier,
:func:`on_four_ranks` (pp = 4, and dp 2 x pp 2 under ``ft.shard``: ddp, zero1, zero2, fsdp) once each; the tests of
``tests/transforms/test_pipeline.py`` compare what they return against one process computed in
the parent (:func:`reference`). The settings below are the same in the parent and the ranks.
"""

from __future__ import annotations

import importlib.util

import torch

import ftrain as ft
from ftrain.distributed.pipeline.runner import refusal
from ftrain.distributed.tensor_parallel.plans import gpt_plan

from _tiny import lm_batch, lm_loss, tiny_gpt

ROWS, STEPS, MICRO = 8, 3, 4
# unequal valid tokens per row, so the micro-batches' counts differ: the one division by the
# whole batch's count is what makes the pipeline equal one process
LENGTHS = (2, 5, 16, 16, 7, 1, 16, 9)
ALL = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble", "zbv")
# those this torch runs over gloo (torch 2.11's zbv cannot start there: ft.pipeline says so)
SCHEDULES = tuple(s for s in ALL if refusal(s, "gloo") is None)


FOUR = tuple(s for s in ("1f1b", "interleaved-1f1b", "zbv") if s in SCHEDULES)


def batches(steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    return [lm_batch(ROWS, seed=100 + i, lengths=LENGTHS) for i in range(steps)]


def adamw():
    # clipped: clip_by_global_norm must see the whole model's norm (0.5 is below every step's)
    return ft.optim.chain(
        ft.optim.clip_by_global_norm(0.5),
        ft.optim.adamw(1e-3, weight_decay=0.1, mask=ft.optim.decay_mask),
    )


def sgd():
    return ft.optim.sgd(0.5, momentum=0.9)


def composed(step, micro_batches: int):
    return ft.accumulate(ft.checkpoint(ft.autocast(step, torch.bfloat16)), micro_batches)


# name: (optimizer, model options, transforms on the pipelined step, on the one-process step,
# donate). Under bf16/fp16 the optimizer is SGD, linear in the gradients: the sums of the
# micro-batches' gradients are associated differently (a tied embedding's two stages are summed
# after all micro-batches), and Adam would turn that fp32 rounding, on a gradient that is zero in
# exact arithmetic (attention's key bias), into steps of the size of the learning rate.
CONFIGS = {
    "plain": (adamw, {}, lambda s: s, lambda s: s, False),
    "donated": (adamw, {}, lambda s: s, lambda s: s, True),
    "untied": (adamw, {"tie_weights": False}, lambda s: s, lambda s: s, False),
    # 2 pieces of 4 micro-batches each: the one-process step runs the same 8 micro-batches
    "composed": (sgd, {}, lambda s: composed(s, 2), lambda s: composed(s, 2 * MICRO), False),
    "sgd": (sgd, {}, lambda s: s, lambda s: s, False),  # fp32: what fp16 approximates
    "fp16": (
        sgd,
        {},
        lambda s: ft.autocast(s, torch.float16),
        lambda s, k=MICRO: ft.accumulate(ft.autocast(s, torch.float16), k),
        False,
    ),
    "fp16 static": (
        sgd,
        {},
        lambda s: ft.autocast(s, torch.float16, loss_scale=1024.0),
        lambda s, k=MICRO: ft.accumulate(ft.autocast(s, torch.float16, loss_scale=1024.0), k),
        False,
    ),
}


def _metrics(m: dict) -> dict[str, float]:
    return {k: float(v) for k, v in m.items()}


FP16 = ("fp16", "fp16 static")


def reference(config: str = "plain", steps: int = STEPS, n_layer: int = 4, **kw_one):
    """One process, the whole model: (state after ``steps``, each step's metrics). ``kw_one``:
    for the fp16 configurations, ``micro_batches`` (default: the pipeline's)."""
    opt, kw, _, one, donate = CONFIGS[config]
    model = tiny_gpt(n_layer=n_layer, **kw)
    state = ft.TrainState.create(ft.params_of(model), opt())
    step = ft.train_step(lm_loss(model), opt(), donate=donate)
    step = one(step, kw_one["micro_batches"]) if kw_one else one(step)
    out = []
    for b in batches(steps):
        state, m = step(state, b)
        out.append(_metrics(m))
    return state, out


def _run(mesh, config: str, schedule: str, *, n_layer: int = 4, shard: str | None = None,
         steps: int = STEPS, save: str | None = None, microbatches: int = MICRO):  # fmt: skip
    opt, kw, many, _, donate = CONFIGS[config]
    model = tiny_gpt(n_layer=n_layer, **kw)
    pp = ft.pipeline(model, mesh, schedule=schedule, microbatches=microbatches)
    state = ft.TrainState.create(ft.params_of(model), opt())
    step = ft.train_step(lm_loss(model), opt(), donate=donate)
    if mesh["tp"].size() > 1:  # tensor-parallel stages: the matrices split, then the stages kept
        tp = ft.tensor_parallel(model, gpt_plan(), mesh)
        state, step = tp.shard_state(state), tp(step)
    state = pp.shard_state(state)
    step = many(pp(step))
    dp = mesh["dp"].size()
    if shard is not None:
        state = ft.shard_state(state, shard, mesh=mesh["dp"])
        step = ft.shard(step, shard, mesh=mesh["dp"])
    me = mesh["dp"].get_local_rank()
    per = ROWS // dp
    out = []
    for b in batches(steps):
        state, m = step(state, {k: v[me * per : (me + 1) * per] for k, v in b.items()})
        out.append(_metrics(m))
    held = ft.distributed.local_bytes(state)  # at rest: what this process keeps between steps
    if save is not None:  # each rank writes its stages' pieces (a checkpoint of the whole)
        ft.save(state, save, pipeline=pp)
    if shard is not None or mesh["tp"].size() > 1:
        state = ft.unshard_state(state)  # dp's and tp's pieces whole, then the stages
    return {
        "state": pp.unshard_state(state),
        "metrics": out,
        "keys": sorted(pp.keys),
        "bytes": held,
        "path": save,
    }


def _resumed(mesh, path: str) -> dict:
    """2 steps, a checkpoint of the stages' pieces, then a fresh pipeline of another schedule
    loads it onto its own stages and takes the 3rd step: equal to 3 steps in one go. Also a
    whole checkpoint (rank 0's) of the same state, loaded onto the same stages."""
    model = tiny_gpt(n_layer=4)
    pp = ft.pipeline(model, mesh, schedule="1f1b", microbatches=MICRO)
    state = pp.shard_state(ft.TrainState.create(ft.params_of(model), adamw()))
    step = pp(ft.train_step(lm_loss(model), adamw()))
    for b in batches(2):
        state, _ = step(state, b)
    ft.save(state, f"{path}-pp2", pipeline=pp)
    whole = pp.unshard_state(state)
    if torch.distributed.get_rank() == 0:
        ft.save(whole, f"{path}-whole")
    torch.distributed.barrier()
    again = ft.pipeline(model, mesh, schedule="interleaved-1f1b", microbatches=MICRO)
    like = again.shard_state(ft.TrainState.create(ft.params_of(model), adamw()))
    loaded = ft.load(f"{path}-pp2", like=like, pipeline=again)
    from_whole = ft.load(f"{path}-whole", like=like, pipeline=again)
    state, _ = again(ft.train_step(lm_loss(model), adamw()))(loaded, batches()[2])
    return {"state": again.unshard_state(state), "saved": whole, "path": f"{path}-pp2",
            "loaded": loaded, "laid out": again.shard_state(whole), "from whole": from_whole}  # fmt: skip


def _loaded(path: str, mesh=None, *, schedule: str = "1f1b", shard: str | None = None) -> dict:
    """The checkpoint at ``path`` (of the 4-layer model and ``adamw``) loaded onto this layout,
    each rank reading its part, gathered whole again; on ``mesh`` None, plain data parallelism
    over every process. With pp alone, also the whole state after one more step (the 4th)."""
    model = tiny_gpt(n_layer=4)
    fresh = ft.TrainState.create(ft.params_of(model), adamw())
    if mesh is None:
        return {"state": ft.unshard_state(ft.load(path, like=ft.shard_state(fresh, shard)))}
    pp = ft.pipeline(model, mesh, schedule=schedule, microbatches=MICRO)
    tp = ft.tensor_parallel(model, gpt_plan(), mesh) if mesh["tp"].size() > 1 else None
    like = pp.shard_state(fresh if tp is None else tp.shard_state(fresh))
    like = like if shard is None else ft.shard_state(like, shard, mesh=mesh["dp"])
    state = ft.load(path, like=like, pipeline=pp)
    out = {"state": pp.unshard_state(ft.unshard_state(state))}
    if mesh.size() == mesh["pp"].size():
        state, _ = pp(ft.train_step(lm_loss(model), adamw()))(state, batches(4)[3])
        out["next"] = pp.unshard_state(state)
    return out


def _errors(mesh) -> dict[str, str]:
    model = tiny_gpt(n_layer=4)
    pp = ft.pipeline(model, mesh, schedule="1f1b", microbatches=MICRO)
    state = pp.shard_state(ft.TrainState.create(ft.params_of(model), adamw()))
    step = pp(ft.train_step(lm_loss(model), adamw()))
    out = {}
    try:  # 6 rows do not split into 4 equal micro-batches
        step(state, lm_batch(6, seed=1))
    except ValueError as e:
        out["rows"] = str(e)
    try:  # the laid-out state again
        pp.shard_state(state)
    except ValueError as e:
        out["twice"] = str(e)
    try:  # the whole state, not laid out
        step(ft.TrainState.create(ft.params_of(model), adamw()), lm_batch(8, seed=1))
    except ValueError as e:
        out["whole"] = str(e)
    return out


def on_two_ranks(tmp: str) -> dict:
    torch.set_num_threads(1)
    mesh = ft.distributed.pipeline.pp_mesh(pp=2)
    out = {f"schedule {s}": _run(mesh, "plain", s) for s in SCHEDULES}
    for config in CONFIGS:
        if config not in ("plain", "sgd"):
            out[config] = _run(mesh, config, "1f1b")
    out["resumed"] = _resumed(mesh, f"{tmp}/ckpt")
    out["errors"] = _errors(mesh)
    out["errors"]["one rank"] = _one_rank_fails(mesh, f"{tmp}/ckpt-pp2")
    return out


def _one_rank_fails(mesh, path: str) -> str:
    """A pipelined load whose checkpoint only rank 0 finds: every rank raises, naming rank 1
    (none waits in the trees' exchange for a rank that stopped)."""
    model = tiny_gpt(n_layer=4)
    pp = ft.pipeline(model, mesh, schedule="1f1b", microbatches=MICRO)
    like = pp.shard_state(ft.TrainState.create(ft.params_of(model), adamw()))
    mine = path if torch.distributed.get_rank() == 0 else f"{path}-not-here"
    try:
        ft.load(mine, like=like, pipeline=pp)
    except ft.CheckpointError as e:
        return str(e)
    return "loaded"


def on_four_ranks(tmp: str) -> dict:
    """The runs below, each saving its stages' pieces to ``tmp/<name>``; then the dp 2 x pp 2
    zero1 checkpoint loaded onto other layouts (``"onto ..."``)."""
    torch.set_num_threads(1)
    out = {}
    pp4 = ft.distributed.pipeline.pp_mesh(pp=4)
    for s in FOUR:
        out[f"pp4 {s}"] = _run(pp4, "plain", s, n_layer=8)
    if (
        importlib.util.find_spec("transformers") is not None
    ):  # tests/distributed/pipeline/test_hf.py
        from _pipeline_hf import pipelined

        for kind, tie in (("gpt2", None), ("llama", False)):
            out[f"hf {kind} pp4"] = pipelined(pp4, kind, "1f1b", tie)
    mesh = ft.distributed.pipeline.pp_mesh(pp=2)  # dp 2 x pp 2
    for shard in ("ddp", "zero1", "zero2", "fsdp"):
        name = f"dp2 pp2 {shard}"
        out[name] = _run(mesh, "plain", "1f1b", shard=shard, save=f"{tmp}/{name}")
    # fsdp under accumulate (2 pieces), checkpoint and bf16: 2 micro-batches of 1 row per piece,
    # the rows of the one-process run's 8 micro-batches
    out["dp2 pp2 fsdp composed"] = _run(mesh, "composed", "1f1b", shard="fsdp", microbatches=2)
    # fp16 loss scaling: the stages' gradients reduce-scattered after the engine reweights them.
    # 2 micro-batches of 2 rows, as one process's 4: with 1-row micro-batches a short first row
    # makes the pipeline's per-step unit small, a step overflows and is skipped (as it does in
    # one process with 8 micro-batches of 1 row), and the runs cannot be compared step by step
    out["dp2 pp2 fsdp fp16"] = _run(mesh, "fp16", "1f1b", shard="fsdp", microbatches=2)
    tp2 = ft.distributed.pipeline.pp_mesh(pp=2, tp=2)  # pp 2 x tp 2
    out["pp2 tp2"] = _run(tp2, "plain", "interleaved-1f1b", shard="ddp", save=f"{tmp}/pp2 tp2")
    saved = f"{tmp}/dp2 pp2 zero1"
    out["onto pp4"] = _loaded(saved, pp4)
    out["onto dp2 pp2 zero2"] = _loaded(saved, mesh, schedule="interleaved-1f1b", shard="zero2")
    out["onto pp2 tp2"] = _loaded(saved, tp2)
    out["onto dp4 zero1"] = _loaded(saved, shard="zero1")
    out["onto dp2 pp2 fsdp"] = _loaded(saved, mesh, shard="fsdp")
    return out


# The 3-D runs: the smallest model and run that still cross every boundary (a block per stage;
# a second step, which reads the first's optimizer state): 8 processes share the suite's 2 cores.
EIGHT = dict(n_layer=2, steps=2)


def on_eight_ranks() -> dict:
    """The 3-D mesh: dp 2 x pp 2 x tp 2, zero1 over dp; then fsdp over dp (a few seconds more:
    the first run pays for the start-up)."""
    torch.set_num_threads(1)
    mesh = ft.distributed.pipeline.pp_mesh(pp=2, tp=2)
    return {
        "dp2 pp2 tp2": _run(mesh, "plain", "1f1b", shard="zero1", **EIGHT),
        "dp2 pp2 tp2 fsdp": _run(mesh, "plain", "1f1b", shard="fsdp", **EIGHT),
    }
