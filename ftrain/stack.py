"""Ensembles as one state: ``ft.stack`` and ``ft.unstack``.

K train states of the same structure become one :class:`~ftrain.TrainState` whose every leaf
(params, optimizer state, ``step``, ``rng``, ``extra``) has a leading *member* dimension of size
K, and back. ``ft.vmap`` trains such a state; ``ft.save``/``ft.load`` keep it like any other.
A stacked state is recognised by its ``rng``: one key per member (shape ``[K]``), where a single
state has one 0-d key.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ftrain import tree
from ftrain.state import TrainState

__all__ = ["stack", "unstack", "members", "is_stacked"]

_TREES = ("params", "opt_state", "extra")  # the TensorDict fields; step and rng are tensors


def is_stacked(state: TrainState) -> bool:
    """Whether ``state`` holds an ensemble (``state.rng`` has one key per member)."""
    return state.rng.dim() == 1


def _flat(state: TrainState) -> dict[str, torch.Tensor]:
    """Every leaf of ``state`` keyed by its dotted path (``params.blocks.0.attn.qkv.weight``)."""
    out = {}
    for field in _TREES:
        for path, t in tree.to_flat(getattr(state, field)).items():
            out[f"{field}.{path}"] = t
    out["step"], out["rng"] = state.step, state.rng
    return out


def _rebuilt(like: TrainState, leaves: list[torch.Tensor]) -> TrainState:
    """A state with the structure of ``like`` (empty sub-trees included) holding ``leaves``, in
    the order of :func:`_flat`."""
    fields, i = {}, 0
    for field in _TREES:
        tdef = tree.structure(getattr(like, field))
        n = len(tdef.paths)
        fields[field] = tdef.unflatten(leaves[i : i + n])
        i += n
    return TrainState(**fields, step=leaves[i], rng=leaves[i + 1], batch_size=[])


def _spec(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


def stack(states: Sequence[TrainState]) -> TrainState:
    """One state holding the K ``states`` as members: every leaf is ``torch.stack`` of theirs.

    The states must have the same structure: the same keys in ``params``, ``opt_state`` and
    ``extra``, and the same shape, dtype and device at each key (their values, ``step`` and
    ``rng`` included, may differ). A mismatch is an error naming the first differing key.
    Each member's hyper-parameters injected by ``ftrain.optim.inject_hyperparams`` are its own.
    A step with transforms that keep state in ``extra`` (fp16 loss scale, ema) needs it present
    before stacking: stack ``plain_step.init_extra(s)`` for each state ``s``.

    **Invariant:** ``ft.unstack(ft.stack(states))`` equals ``states``, leaf for leaf.
    """
    if isinstance(states, TrainState) or not isinstance(states, Sequence) or not states:
        raise TypeError(
            "ft.stack(states): states must be a non-empty list of ft.TrainState, got "
            f"{type(states).__name__}."
        )
    for i, s in enumerate(states):
        if not isinstance(s, TrainState):
            raise TypeError(
                f"ft.stack(states): states[{i}] is a {type(s).__name__}, not an ft.TrainState."
            )
        if is_stacked(s) or s.rng.dim() != 0 or s.step.dim() != 0:
            raise ValueError(
                f"ft.stack(states): states[{i}] is already stacked (state.rng has shape "
                f"{list(s.rng.shape)}); stack single states, or ft.unstack it first."
            )
    flats = [_flat(s) for s in states]
    first = flats[0]
    for i, flat in enumerate(flats[1:], start=1):
        _check_same(first, flat, i)
        for field in _TREES:  # the same leaves, but maybe other empty sub-trees
            if tree.structure(getattr(states[i], field)) != tree.structure(
                getattr(states[0], field)
            ):
                raise ValueError(
                    f"ft.stack(states): state.{field} of states[{i}] has another structure than "
                    "that of states[0] (empty entries differ); build both with the same optimizer "
                    "and transforms."
                )
    ordered = [[f[k] for f in flats] for k in first]
    return _rebuilt(states[0], [torch.stack(ts) for ts in ordered])


def _check_same(first: dict, other: dict, i: int) -> None:
    """Raise naming the first key where ``other`` (states[i]) differs from states[0]."""
    for key, t in first.items():
        if key not in other:
            raise ValueError(
                f"ft.stack(states): states[{i}] has no {key!r}, which states[0] has; stacked "
                "states must share their structure (same model, optimizer and transforms)."
            )
        if _spec(other[key]) != _spec(t):
            raise ValueError(
                f"ft.stack(states): {key!r} is {_spec(t)} in states[0] but "
                f"{_spec(other[key])} in states[{i}]; stacked states must match in shape, dtype "
                "and device at every key."
            )
    extra = [k for k in other if k not in first]
    if extra:
        raise ValueError(
            f"ft.stack(states): states[{i}] has {extra[0]!r}, which states[0] has not; stacked "
            "states must share their structure (same model, optimizer and transforms)."
        )


def members(state: TrainState, where: str = "ft.unstack(state)") -> int:
    """The number of members K of a stacked ``state``, after checking that every leaf has a
    leading dimension of size K; errors name ``where`` and the first leaf that has not."""
    if not isinstance(state, TrainState):
        raise TypeError(f"{where}: expected an ft.TrainState, got {type(state).__name__}.")
    if not is_stacked(state):
        raise ValueError(
            f"{where}: the state is not stacked (state.rng has shape {list(state.rng.shape)}; a "
            "stacked state has one key per member, shape [K]). Build one with "
            "ft.stack([state_1, ..., state_K])."
        )
    k = state.rng.shape[0]
    for key, t in _flat(state).items():
        if t.dim() == 0 or t.shape[0] != k:
            raise ValueError(
                f"{where}: {key!r} has shape {list(t.shape)}, without the leading member "
                f"dimension of size {k} that every leaf of a stacked state has."
                + (
                    " A transform added it after stacking: stack plain_step.init_extra(s) of "
                    "each state s instead."
                    if key.startswith("extra")
                    else " Build stacked states with ft.stack, not by hand."
                )
            )
    return k


def unstack(state: TrainState) -> list[TrainState]:
    """The K member states of a stacked ``state`` (the inverse of :func:`stack`).

    Each member's tensors are its own contiguous copies: training, donating or saving one
    leaves the stacked state and the other members as they were.

    **Invariant:** ``ft.stack(ft.unstack(state))`` equals ``state``; ``ft.unstack(state)[i]``
    trained by the plain step continues as member i would inside ``ft.vmap`` of that step where
    no random numbers are drawn, to the rounding of batched kernels (1e-5 relative in the tests;
    see ``ft.vmap``, also for dropout).
    """
    k = members(state)
    leaves = list(_flat(state).values())
    return [_rebuilt(state, [t[i].clone() for t in leaves]) for i in range(k)]
