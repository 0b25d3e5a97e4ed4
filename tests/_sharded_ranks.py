"""The sharded-checkpoint checks that need processes, in two launches (2 ranks, then 3).

``conftest.py``'s session fixture ``sharded_checkpoints`` runs :func:`on_two` then
:func:`on_three` once. Each rank writes what it found to ``<root>/<name>-rank<r>.json``, and the
tests of ``test_io_sharded.py``, ``test_io_reshard.py`` and ``test_io_consolidate.py`` read those
files and the checkpoints left in ``root``:

    <opt>-whole      the reference: saved whole by one process (opt: adamw, adamw8bit, adafactor)
    <opt>-fsdp2      saved sharded by 2 ranks under fsdp (and <opt>-fsdp2-bg in the background)
    <opt>-zero1-2    saved by 2 ranks under zero1 (params whole, optimizer state sharded)
    <opt>-ddp-2, <opt>-zero2-2   saved by 2 ranks under ddp (by rank 0) and zero2
    <opt>-fsdp3      saved by 3 ranks under fsdp (uneven rows: 22/22/20)
    run/             checkpoint-2 whole, and what a save killed on rank 1 left (a .tmp- directory)
"""

from __future__ import annotations

import json
import os

import torch

import ftrain as ft
from ftrain import tree
from ftrain.distributed import STRATEGIES, local_bytes, shard_state, unshard_state
from ftrain.io import tensorfile
from ftrain.testing import track_allocations

from _tiny import lm_batch, lm_loss, tiny_gpt

OPTS = ("adamw", "adamw8bit", "adafactor")


def whole_state(opt_name: str, steps: int = 2) -> ft.TrainState:
    """A tiny GPT's state after ``steps`` steps (0: fresh), with an ema of the params and an fp16
    loss scale in ``state.extra``; the same on every process (one thread, same seed)."""
    opt = {
        "adamw": ft.optim.adamw(1e-2),
        "adamw8bit": ft.optim.adamw8bit(1e-2),
        "adafactor": ft.optim.adafactor(1e-2),
    }[opt_name]
    model = tiny_gpt()
    step = ft.ema(ft.autocast(ft.train_step(lm_loss(model), opt), torch.float16), 0.9)
    state = step.init_extra(ft.TrainState.create(ft.params_of(model), opt, seed=0))
    for i in range(steps):
        state, _ = step(state, lm_batch(4, seed=i))
    return state


def differing(a: ft.TrainState, b: ft.TrainState) -> list[str]:
    """The dotted keys whose tensors are not bitwise equal (or whose trees differ)."""
    ta = a.to_tensordict().flatten_keys(".")
    tb = b.to_tensordict().flatten_keys(".")
    if sorted(ta.keys()) != sorted(tb.keys()):
        return ["<keys differ>"]
    return [
        k
        for k in ta.keys()
        if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k].view(-1), tb[k].view(-1))
    ]


def layouts(state: ft.TrainState) -> list:
    """The placement of every leaf (None for a plain tensor)."""
    return [
        tuple(map(str, t.placements)) if hasattr(t, "placements") else None
        for t in tree.leaves(state.to_tensordict())
    ]


def _report(root: str, name: str, found: dict) -> None:
    with open(os.path.join(root, f"{name}-rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(found, f)


def on_two(root: str) -> None:
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    found: dict = {"loads": {}, "memory": {}}
    for opt in OPTS:
        whole = whole_state(opt)
        if rank == 0:
            ft.save(whole, f"{root}/{opt}-whole")  # the reference: one process, whole tensors
        fsdp = shard_state(whole, "fsdp")
        whole_bytes = local_bytes(whole)
        with track_allocations() as blocking:
            ft.save(fsdp, f"{root}/{opt}-fsdp2")
        with track_allocations() as copying:
            handle = ft.save(fsdp, f"{root}/{opt}-fsdp2-bg", blocking=False)
        handle.wait()
        with track_allocations() as gathering:  # the old way: gather whole, then save
            ft.save(unshard_state(fsdp), f"{root}/{opt}-gathered-{rank}")
        biggest = max(t.numel() * t.element_size() for t in tree.leaves(whole.to_tensordict()))
        found["memory"][opt] = {
            "blocking": blocking.peak,
            "background": copying.peak,
            "gathered": gathering.peak,
            "local": local_bytes(fsdp),
            "whole": whole_bytes,
            "biggest": biggest,
        }
        ddp = shard_state(whole, "ddp")  # every process: laying out a state is a collective
        if rank == 0:  # a ddp state is whole on every process: one of them saves it
            ft.save(ddp, f"{root}/{opt}-ddp-2")
        for strategy in ("zero1", "zero2"):  # sharded states: every process saves its pieces
            ft.save(shard_state(whole, strategy), f"{root}/{opt}-{strategy}-2")
        torch.distributed.barrier()  # the reference is on disk
        _load_each_way(found, root, opt, ("whole", "fsdp2", "fsdp2-bg"), whole, world=2)
    found["columns"] = _columns(root, whole_state("adamw"))
    _report(root, "two", found)


def _load_each_way(found: dict, root: str, opt: str, sources, reference, world: int) -> None:
    """Load each saved ``{opt}-{src}`` onto this world under every strategy; record whether the
    gathered result differs from ``reference`` and whether the layout is ``like``'s."""
    fresh = whole_state(opt, steps=0)
    for src in sources:
        for strategy in STRATEGIES:
            like = shard_state(fresh, strategy)
            got = ft.load(f"{root}/{opt}-{src}", like=like)
            found["loads"][f"{opt} {src} -> {world} {strategy}"] = {
                "differs": differing(unshard_state(got), reference),
                "layout": layouts(got) == layouts(like),
            }


def _columns(root: str, whole: ft.TrainState) -> dict:
    """A layout split along another dimension (tensor parallelism's ``Shard(1)``): the
    embedding's columns across the ranks. It saves and loads as pieces of the same format."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from ftrain.distributed import default_mesh

    params = whole.params.clone()
    params["wte", "weight"] = distribute_tensor(whole.params["wte", "weight"], default_mesh(),
                                                [Shard(1)])  # fmt: skip
    by_columns = whole.replace(params=params)
    ft.save(by_columns, f"{root}/columns")
    meta = ft.load_meta(f"{root}/columns")["index"]["params.wte.weight"]
    back = ft.load(f"{root}/columns", like=by_columns)
    as_rows = ft.load(f"{root}/columns", like=shard_state(whole, "fsdp"))
    return {
        "placements": meta["placements"],
        "offsets": [piece["offsets"] for piece in meta["pieces"]],
        "same layout": layouts(back) == layouts(by_columns),
        "differs": differing(unshard_state(back), whole),
        "differs as rows": differing(unshard_state(as_rows), whole),
    }


def on_three(root: str) -> None:
    torch.set_num_threads(1)
    found: dict = {"loads": {}}
    for opt in OPTS:
        reference = ft.load(f"{root}/{opt}-whole")
        sources = ("fsdp2", "ddp-2", "zero1-2", "zero2-2")
        _load_each_way(found, root, opt, sources, reference, world=3)
        ft.save(shard_state(reference, "fsdp"), f"{root}/{opt}-fsdp3")  # uneven: 22/22/20 rows
    _report(root, "three", found)
    # A rank killed while writing its file: the run folder keeps its previous checkpoint.
    state = shard_state(ft.load(f"{root}/adamw-whole"), "fsdp")
    ft.save_checkpoint(f"{root}/run", state)
    if torch.distributed.get_rank() == 1:
        real = tensorfile.write_lazy  # what a sharded save writes each rank's file with

        def half_then_die(file, specs, get, metadata=None):
            real(file, specs, get, metadata)
            with open(file, "r+b") as f:
                f.truncate(os.path.getsize(file) // 2)
            os._exit(9)

        tensorfile.write_lazy = half_then_die
    ft.save_checkpoint(f"{root}/run", state.replace(step=state.step + 1))
