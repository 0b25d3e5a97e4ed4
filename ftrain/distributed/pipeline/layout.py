"""Where a pipelined state's tensors live: each rank keeps its stages' params and the optimizer
and ``extra`` entries of them (a path ending with a params key: a moment, a factored statistic);
everything else (counters, the rng) stays on every rank. :func:`keep_stages` cuts a whole tree
down to one rank's, :func:`gather_stages` puts every rank's back together, in the whole tree's
order: ``gather_stages(keep_stages(t))`` is ``t``, bitwise (``ft.pipeline``'s ``shard_state`` and
``unshard_state``). :func:`whole_tree` does the same for the trees a checkpoint records (no
tensor moves): what lets each rank save and load only its own stages' pieces."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from tensordict import TensorDict

__all__ = ["keep_stages", "gather_stages", "merged", "param_of", "whole_tree"]


def _entries(td, prefix: str = "") -> list[tuple[str, torch.Tensor | None]]:
    """``(dotted path, tensor)`` of every leaf of ``td`` in order, and ``(path, None)`` for each
    empty TensorDict in it (a stateless optimizer's state): what rebuilds the same tree."""
    out: list[tuple[str, torch.Tensor | None]] = []
    for k in td.keys():
        v, path = td.get(k), f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out.append((path, v))
        elif len(v.keys()) == 0:
            out.append((path, None))
        else:
            out.extend(_entries(v, path + "."))
    return out


def _build(entries: Sequence[tuple[str, torch.Tensor | None]]):
    """The TensorDict of ``entries`` (see :func:`_entries`), nested in their order."""
    root: dict = {}
    for path, t in entries:
        *parents, leaf = path.split(".")
        node = root
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = {} if t is None else t

    def make(node: dict):
        td = TensorDict({}, batch_size=[])
        for k, v in node.items():
            td.set(k, make(v) if isinstance(v, dict) else v)
        return td

    return make(root)


def param_of(path: str, keys: Mapping[str, int]) -> str | None:
    """The params key ``path`` ends with (the longest), or None."""
    parts = path.split(".")
    for i in range(len(parts)):
        key = ".".join(parts[i:])
        if key in keys:
            return key
    return None


def keep_stages(td, mine: set[str], keys: Mapping[str, int]):
    """``td`` without the leaves that belong to another rank's params (a leaf whose path ends
    with a params key: a moment, a factored statistic); its other leaves and empty parts kept."""
    entries = _entries(td)
    kept = [(p, t) for p, t in entries if t is None or param_of(p, keys) in (None, *mine)]
    return td if len(kept) == len(entries) else _build(kept)


def merged(listings: Sequence[Sequence[tuple[str, object]]], keys: Mapping[str, int]):
    """The entries ``(path, value)`` of several ranks' parts of one tree (each listed in its
    tree's order: :func:`keep_stages` of the whole tree, replicas allowed), each path once with
    the first rank's value, in the whole tree's order: the entries of each params key in the
    model's key order (``keys``), after the entries before them. Pure: no collective."""
    first, prefixes = {}, {}

    def prefix(p: str) -> str:
        key = param_of(p, keys)
        return p[: len(p) - len(key)] if key else p

    for listed in listings:
        for p, value in listed:
            first.setdefault(p, value)
            prefixes.setdefault(prefix(p), len(prefixes))

    def order(p: str) -> tuple[int, int]:
        key = param_of(p, keys)
        return prefixes[prefix(p)], keys[key] if key else -1

    return [(p, first[p]) for p in sorted(first, key=order)]


def gather_stages(td, keys: Mapping[str, int], group):
    """Every rank's leaves of ``td`` on every rank, each broadcast from the first rank holding
    it (``Pipeline.unshard_state``), in the order a whole state has them (:func:`merged`)."""
    entries = _entries(td)
    local = [(p, None if t is None else (str(t.dtype), tuple(t.shape))) for p, t in entries]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, local, group=group)  # paths, dtypes and shapes only
    holder = {}
    for r, listed in enumerate(everyone):
        for p, _ in listed:
            holder.setdefault(p, r)
    mine = dict(entries)
    me = dist.get_rank(group)
    device = next((t.device for t in mine.values() if t is not None), torch.device("cpu"))
    out = []
    for p, spec in merged(everyone, keys):
        if spec is None:
            out.append((p, None))
            continue
        if holder[p] == me:
            t = mine[p]
            sent = t.contiguous()
        else:
            dtype, shape = spec
            t = sent = torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]), device=device)
        dist.broadcast(sent, src=dist.get_global_rank(group, holder[p]), group=group)
        out.append((p, t))
    return _build(out)


def whole_tree(trees: Sequence[dict], keys: Mapping[str, int]) -> dict:
    """The checkpoint tree (``ftrain.io``'s: a dict per TensorDict, ``"dtype[shape]"`` per
    tensor) of the whole state, from the trees of its ranks' parts (:func:`keep_stages`'s, from
    any ranks, replicas included), in the whole state's order (:func:`merged`). Pure."""

    def listing(node: dict, prefix: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for k, v in node.items():
            if isinstance(v, dict) and v:
                out.extend(listing(v, f"{prefix}{k}."))
            else:
                out.append((f"{prefix}{k}", v))  # a tensor's spec, or {} (an empty TensorDict)
        return out

    root: dict = {}
    for path, v in merged([listing(t, "") for t in trees], keys):
        *parents, leaf = path.split(".")
        node = root
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = {} if isinstance(v, dict) else v
    return root
