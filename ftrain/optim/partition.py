"""A different optimizer for each group of parameters: :func:`partition` (optax's ``partition``).

Muon for the hidden matrices and AdamW for the embeddings, head, norms and biases; another learning
rate for one block: each group of parameters is named by a label, and each label has its own
transform with its own state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tensordict import TensorDict, TensorDictBase

from ftrain import tree
from ftrain.optim.base import (
    GradientTransformation,
    LeafContext,
    has_own_apply,
    leaf_apply,
    leaf_update,
    leafwise,
)
from ftrain.tree import TreeDef

__all__ = ["partition"]

# One label's share of the params: its name, the positions of its leaves in the params' leaf
# list (in order), and the key structure of the sub-tree they form.
Group = tuple[str, list[int], TreeDef]


def _flat_labels(labels, where: str) -> dict[str, str]:
    """``{"a.b.c": label}`` from a TensorDict of strings (non-tensor leaves) or a nested mapping of
    strings, keyed like the params."""
    if isinstance(labels, TensorDictBase):
        labels = labels.to_dict()  # non-tensor leaves come back as the strings they hold
    if not isinstance(labels, Mapping):
        raise TypeError(
            f"partition(transforms, labels): {where} must be a TensorDict of strings keyed like "
            "the params (TensorDict({'wte': {'weight': 'adamw'}, ...})), a nested dict of strings, "
            f"or a function params -> either; got {type(labels).__name__}."
        )
    out: dict[str, str] = {}

    def walk(d: Mapping, prefix: str) -> None:
        for k, v in d.items():
            path = f"{prefix}{k}"
            if isinstance(v, Mapping):
                walk(v, path + tree.SEP)
            elif isinstance(v, str):
                out[path] = v
            else:
                raise TypeError(
                    f"partition: the label of {path!r} is {type(v).__name__} {v!r}; every label "
                    "must be a string naming one of the transforms."
                )

    walk(labels, "")
    return out


def _groups(transforms: Mapping, labels, params: TensorDictBase) -> list[Group]:
    """Check ``labels`` against ``params`` and ``transforms``; one group per transform, in the
    order of ``transforms``."""
    got = labels(params) if callable(labels) else labels
    by_path = _flat_labels(got, "labels(params)" if callable(labels) else "labels")
    paths = tree.paths(params)
    missing = [p for p in paths if p not in by_path]
    extra = sorted(set(by_path) - set(paths))
    if missing or extra:
        raise KeyError(
            f"partition: labels must name every parameter, and only those: no label for "
            f"{missing}, labels for keys the params do not have {extra}. Give each parameter's "
            "dotted key one label."
        )
    unknown: dict[str, list[str]] = {}
    for p in paths:
        if by_path[p] not in transforms:
            unknown.setdefault(by_path[p], []).append(p)
    if unknown:
        detail = "; ".join(f"{lab!r} (on {ps[:3]}{' ...' if len(ps) > 3 else ''})"
                           for lab, ps in unknown.items())  # fmt: skip
        raise KeyError(
            f"partition: labels with no transform: {detail}. The transforms are "
            f"{list(transforms)}: add one for each label, or label those params with one of them."
        )
    leaves, groups = tree.leaves(params), []
    for label in transforms:
        idx = [i for i, p in enumerate(paths) if by_path[p] == label]
        if not idx:
            raise ValueError(
                f"partition: no parameter has the label {label!r}, so its transform would never "
                f"run. Remove {label!r} from transforms, or label some params with it."
            )
        sub = tree.from_flat({paths[i]: leaves[i] for i in idx})
        groups.append((label, idx, tree.structure(sub)))
    return groups


def partition(
    transforms: Mapping[str, GradientTransformation],
    labels: TensorDictBase | Mapping | Callable[[TensorDictBase], TensorDictBase | Mapping],
) -> GradientTransformation:
    """Update each group of parameters with its own transform: ``transforms[label]`` sees only
    the leaves whose label is ``label``, and keeps its own state.

    **Invariant:** the updates and the state of label ``k`` are bit for bit those of
    ``transforms[k]`` run alone on the sub-tree of the params labelled ``k`` (same keys, same
    order). The state is ``{label: that transform's state}``, in the order of ``transforms``.

    Args:
        transforms: label -> transform, e.g. ``{"muon": muon(0.02), "adamw": adamw(3e-4)}``.
        labels: one string per parameter, keyed like the params: a TensorDict of strings
            (``TensorDict({"w": "muon", "b": "adamw"})``, stored as non-tensor leaves), a nested
            ``dict`` of strings (``{"blocks": {"0": {"weight": "muon", ...}}}``; dotted keys such
            as ``{"blocks.0.weight": "muon"}`` work too), or a function ``params -> labels``,
            evaluated once per params structure (keys and shapes) and remembered, like
            :func:`ftrain.optim.masked`'s mask.

    Checked at ``init``: a parameter without a label, a label for a key the params do not have,
    and a label with no transform are errors naming them. A transform that no parameter is
    labelled with is an error too. Here ftrain is stricter than optax (whose ``partition`` gives
    such a transform an empty state): a transform that never runs is most often a labelling
    mistake (a mask function that matched nothing) that would otherwise train on silently.

    >>> import torch, ftrain as ft
    >>> from ftrain import optim
    >>> params = ft.params_of(torch.nn.Linear(3, 2))
    >>> opt = optim.partition({"decay": optim.adamw(1e-3, weight_decay=0.1),
    ...                        "plain": optim.adam(1e-3)},
    ...                       lambda p: {"weight": "decay", "bias": "plain"})
    >>> state = opt.init(params)
    >>> sorted(state.keys()), list(state["plain", "0", "mu"].keys())
    (['decay', 'plain'], ['bias'])
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(
            "partition(transforms, labels): transforms must be a non-empty mapping label -> "
            "GradientTransformation, e.g. {'muon': optim.muon(0.02), 'adamw': optim.adamw(3e-4)}; "
            f"got {transforms!r}."
        )
    for label, t in transforms.items():
        if not isinstance(label, str) or not label or tree.SEP in label:
            raise ValueError(
                f"partition: each label must be a non-empty string without {tree.SEP!r} (it is a "
                f"key of the state); got {label!r}."
            )
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"partition: transforms[{label!r}] is {type(t).__name__}, not a "
                "GradientTransformation. Pass transforms such as optim.adamw(3e-4)."
            )
    if not (callable(labels) or isinstance(labels, (TensorDictBase, Mapping))):
        _flat_labels(labels, "labels")  # raises the TypeError naming the legal forms
    transforms = dict(transforms)  # a later change to the caller's dict changes nothing here
    fns = {label: leaf_update(t) for label, t in transforms.items()}
    cache: dict = {}

    def resolve(tdef: TreeDef, leaves: list) -> list[Group]:
        # Keyed by plain tuples, so that a step compiled after init finds what init computed.
        key = (tdef.sig, tuple(t.shape for t in leaves)) if callable(labels) else tdef.sig
        got = cache.get(key)
        if got is None:
            got = _groups(transforms, labels, tdef.unflatten(leaves))
            if not tree.compiling():
                cache[key] = got
        return got

    def init(params):
        leaves, tdef = tree.flatten(params)
        groups = resolve(tdef, leaves)
        states = {}
        for label, idx, sub in groups:
            states[label] = transforms[label].init(sub.unflatten([leaves[i] for i in idx]))
        return TensorDict(states, batch_size=[])

    def update(u, s, p, ctx, fns=fns):
        groups = resolve(ctx.tree, p if p is not None else u)
        sdef = ctx.state
        entries = [e if isinstance(e, str) else e[0] for e in sdef.sig]
        if [g[0] for g in groups] != entries:
            raise KeyError(
                f"partition: the state has the entries {entries}, this "
                f"optimizer's labels are {[g[0] for g in groups]}. Build the state with this "
                "optimizer's init(params)."
            )
        out, new_s = list(u), list(s)
        for label, idx, sub in groups:
            lo, hi = sdef.span(label)
            sub_p = None if p is None else [p[i] for i in idx]
            sub_ctx = LeafContext(sub, sdef.child(label), ctx.inplace, ctx.owned)
            new_u, new_s[lo:hi] = fns[label]([u[i] for i in idx], s[lo:hi], sub_p, sub_ctx)
            for i, x in zip(idx, new_u):
                out[i] = x
        return out, new_s

    apply = None
    if any(has_own_apply(t) for t in transforms.values()):  # a fused kernel writes its params
        applies = {label: leaf_apply(t) for label, t in transforms.items()}

        def apply(g, s, p, ctx):  # each group's params, written by its transform
            return update(g, s, p, ctx, applies)

    return leafwise(init, update, apply)
