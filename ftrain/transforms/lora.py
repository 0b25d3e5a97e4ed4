"""LoRA: train low-rank adapters on chosen linear layers, the model's own params frozen.

Freezing is not differentiating: the step's params (what the gradient engine differentiates and
the optimizer keeps state for) are the adapters only, and the frozen base lives in
``state.extra["lora", "base"]``, sharded with the rest of the state. A checkpoint needs only what
training changed: :func:`split_base` takes the base out before saving (``ftrain train`` does) and
:func:`join_base` puts the model's back after loading. Each forward
(the ``forward`` hook) hands the loss function the base with every targeted weight replaced
by ``W + (alpha / rank) * B @ A``, so the user's ``ft.apply(model, params, ...)`` runs the model
unchanged: no module is rewritten, and every transform composes with it as with full training.

    lora = ft.lora(model, rank=8, alpha=16, targets=["attn.qkv", "attn.proj"])
    state = lora.init_state(ft.params_of(model), opt, seed=0)   # params: the adapters
    step = lora(ft.train_step(loss_fn, opt))                    # loss_fn as for full training
    merged = ft.merge_lora(state)                               # plain params for `model`

The cost of forming the merged weight: one ``(out, r) @ (r, in)`` product per target per forward,
and a backward that forms each target's full ``dL/dW`` once (as full fine-tuning does) before
projecting it onto A and B; the merged weights live until backward. No gradient or optimizer
state of the base is ever allocated.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from ftrain import tree
from ftrain.state import TrainState
from ftrain.step import Transform

__all__ = ["Lora", "lora", "merge_lora", "lora_targets", "split_base", "join_base", "ALL_LINEAR"]

# The targets pattern that selects every linear layer except the output head (peft's name).
ALL_LINEAR = "all-linear"


@dataclasses.dataclass(frozen=True, eq=False)
class Lora(Transform):
    """Low-rank adapters on ``targets`` (module paths), the rest frozen; see :func:`lora`.

    Attributes:
        targets: module paths of the adapted layers, as :func:`lora_targets` resolves them.
        fan_in_fan_out: per target, whether its weight is stored ``(in, out)`` (Hugging Face's
            ``Conv1D`` in GPT-2) rather than ``(out, in)`` (``nn.Linear``).
        shapes: per target, ``(in_features, out_features)``.
        rank: the adapters' inner dimension r.
        alpha: the scale numerator: the update is ``alpha / rank * B @ A`` (peft's ``scaling``).
    """

    targets: tuple[str, ...]
    fan_in_fan_out: tuple[bool, ...]
    shapes: tuple[tuple[int, int], ...]
    rank: int = 8
    alpha: float = 16.0

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"ft.lora(rank={self.rank!r}): rank must be an int >= 1 (e.g. 8).")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise ValueError(
                f"ft.lora(alpha={self.alpha!r}): alpha must be a number > 0 (e.g. 16)."
            )

    @property
    def scaling(self) -> float:
        """``alpha / rank``: what ``B @ A`` is multiplied by."""
        return self.alpha / self.rank

    # -- the state ------------------------------------------------------------------------------
    def init_state(self, params: TensorDictBase, optimizer, *, seed: int = 0) -> TrainState:
        """A fresh state: ``params`` (the whole model's, e.g. ``ft.params_of(model)`` or loaded
        weights) frozen in ``state.extra["lora"]``, adapters as the params (A as peft initializes
        it, Kaiming-uniform from ``seed``; B zero, so the model starts as the base), and the
        optimizer's state for the adapters only."""
        _check_base(self, params)
        gen = torch.Generator().manual_seed(seed)
        device = tree.first_leaf(params).device
        adapters = {}
        for path, (fan_in, fan_out) in zip(self.targets, self.shapes):
            bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and peft
            a = torch.rand(self.rank, fan_in, generator=gen, dtype=torch.float32)
            adapters[f"{path}.lora_A"] = (a * 2 - 1).mul_(bound).to(device)
            adapters[f"{path}.lora_B"] = torch.zeros(fan_out, self.rank, device=device)
        adapters = tree.from_flat(adapters)
        state = TrainState.create(adapters, optimizer, seed=seed)
        extra = TensorDict(
            {
                "lora": {
                    "base": params,
                    "scaling": torch.tensor(self.scaling, dtype=torch.float64, device=device),
                    "fan_in_fan_out": tree.from_flat(
                        {
                            p: torch.tensor(f, device=device)
                            for p, f in zip(self.targets, self.fan_in_fan_out)
                        }
                    ),
                }
            },
            batch_size=[],
        )
        return state.replace(extra=extra)

    # -- hooks ----------------------------------------------------------------------------------
    def capabilities(self):
        return {"keeps state.extra['lora']": f"rank={self.rank}"}

    def init(self, state: TrainState) -> TrainState:
        if "lora" not in state.extra.keys():
            raise ValueError(
                "ft.lora: the state holds no frozen base (state.extra['lora']); create it with "
                "lora.init_state(params, optimizer), where lora = ft.lora(model, ...)."
            )
        _check_has_base(state, "ft.lora")
        return state

    def forward(self, fn):
        def with_base(params, batch, state):
            if state is None:
                raise TypeError(
                    "Step.forward(params, batch, state): ft.lora makes the loss function's params "
                    "from the state's frozen base; pass the state."
                )
            return fn(self.merged(params, state), batch, state)

        return with_base

    def merged(self, params: TensorDict, state: TrainState) -> TensorDict:
        """The whole model's params the loss function sees: the frozen base in ``state`` with
        each target's ``B @ A * scaling`` added; gradients flow to ``params`` (the adapters)."""
        base = state.extra["lora", "base"]
        values, tdef = tree.flatten(base)
        values = list(values)
        for path, transposed in zip(self.targets, self.fan_in_fan_out):
            node = params
            for part in path.split("."):
                node = node[part]
            i = tdef.index(f"{path}.weight")
            values[i] = values[i] + _delta(node["lora_B"], node["lora_A"], self.scaling, transposed)
        return tdef.unflatten(values)


def lora(
    model: nn.Module,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: str | Sequence[str] = ALL_LINEAR,
) -> Lora:
    """LoRA for ``model``: a transform to apply to a step, and the state it trains.

    Apply it to a step built for full training (``lora(step)``): the loss function is unchanged.
    Build the state with ``lora.init_state(params, optimizer, seed=...)``; fold the adapters back
    with :func:`merge_lora`.

    Args:
        model: the template the loss function runs with ``ft.apply``; only its layers are read.
        rank: the adapters' inner dimension r (A is ``(r, in)``, B is ``(out, r)``).
        alpha: the update is ``alpha / rank * B @ A`` (peft's ``lora_alpha`` and ``scaling``).
        targets: module-name patterns of the layers to adapt (see :func:`lora_targets`), or
            ``"all-linear"``: every linear layer except the output head.

    Guarantees: the step differentiates only the adapters, so the optimizer state holds only
    adapter entries and no gradient of a base weight is kept; the loss function sees the weights
    ``W + alpha / rank * B @ A``, so its logits and the adapters' gradients equal peft's LoRA
    (``lora_dropout=0``) on the same model and adapters. Errors (a pattern that matches no
    linear layer, a tied weight) are raised here, when the step is built.
    """
    found = lora_targets(model, targets)
    return Lora(
        targets=tuple(found),
        fan_in_fan_out=tuple(t for t, _ in found.values()),
        shapes=tuple(s for _, s in found.values()),
        rank=rank,
        alpha=float(alpha),
    )


def lora_targets(
    model: nn.Module, targets: str | Sequence[str]
) -> dict[str, tuple[bool, tuple[int, int]]]:
    """The layers ``targets`` selects in ``model``: ``{path: (fan_in_fan_out, (in, out))}``.

    A pattern selects a linear layer (``nn.Linear`` or a subclass, or Hugging Face's ``Conv1D``)
    whose module path equals it, ends with ``.`` + it (``"qkv"`` selects ``blocks.0.attn.qkv``),
    or matches it as a glob (``"blocks.*.mlp.fc"``). Each pattern must select at least one;
    ``"all-linear"`` selects every linear layer except the output head (``lm_head`` or the
    model's ``get_output_embeddings()``). A layer whose weight is tied to another parameter is
    refused: its update would reach both places.
    """
    patterns = [targets] if isinstance(targets, str) else list(targets)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(
            f"ft.lora(targets={targets!r}): give module-name patterns (e.g. ['attn.qkv', "
            f"'attn.proj']) or {ALL_LINEAR!r}."
        )
    linears = {name: m for name, m in model.named_modules() if _layout(m) is not None}
    names_of: dict[int, list[str]] = {}  # a tied weight: one tensor under several names
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    tied = {n: names for names in names_of.values() if len(names) > 1 for n in names}
    head = _output_head(model)
    found: dict[str, tuple[bool, tuple[int, int]]] = {}
    for pattern in patterns:
        if pattern == ALL_LINEAR:
            names = [n for n, m in linears.items() if m is not head and n != "lm_head"]
        else:
            names = [n for n in linears if _matches(n, pattern)]
        if not names:
            others = [n for n, _ in model.named_modules() if n and _matches(n, pattern)]
            what = (
                f"it matches {others[:3]}, which are not linear layers"
                if others
                else "it matches no module"
            )
            raise ValueError(
                f"ft.lora(targets=...): pattern {pattern!r} selects no linear layer of "
                f"{type(model).__name__} ({what}). Linear layers: {_short(list(linears))}; give "
                f"a suffix of their names (e.g. {_suffix_hint(linears)!r}) or {ALL_LINEAR!r}."
            )
        for name in names:
            if f"{name}.weight" in tied:
                raise ValueError(
                    f"ft.lora(targets=...): {name!r} has a weight tied to another parameter "
                    f"({tied[name + '.weight']}: one tensor, e.g. an output head tied to the "
                    "embedding), which its update would change too; leave it out of targets."
                )
            found[name] = _layout(linears[name])  # type: ignore[assignment]
    return found


def merge_lora(state: TrainState) -> TensorDict:
    """The params of the adapted model as plain params of the original one: the frozen base with
    every target's ``alpha / rank * B @ A`` added to its weight (a new TensorDict; ``state`` is
    not changed). ``ft.apply(model, merge_lora(state), x)`` equals the LoRA step's forward;
    export, sample and evaluate with it. ``state`` must hold whole tensors (after
    ``ft.unshard_state`` when sharded)."""
    if not isinstance(state, TrainState) or "lora" not in state.extra.keys():
        raise ValueError(
            "ft.merge_lora(state): expected the TrainState of a LoRA run (state.extra['lora'], "
            "made by lora.init_state), got "
            + (type(state).__name__ if not isinstance(state, TrainState) else "a state without it")
            + "."
        )
    _check_has_base(state, "ft.merge_lora(state)")
    entry = state.extra["lora"]
    scaling = float(entry["scaling"])
    flat = {k: v.detach().clone() for k, v in tree.to_flat(entry["base"]).items()}
    adapters = tree.to_flat(state.params)
    for path, transposed in tree.to_flat(entry["fan_in_fan_out"]).items():
        delta = _delta(adapters[f"{path}.lora_B"], adapters[f"{path}.lora_A"], scaling, transposed)
        flat[f"{path}.weight"] += delta.to(flat[f"{path}.weight"].dtype)
    return tree.from_flat(flat)


def split_base(state: TrainState) -> tuple[TrainState, TensorDictBase | None]:
    """``state`` without the frozen base of a LoRA run, and that base; a state that is not a
    LoRA run's (or holds no base) comes back as it is, with None.

    Guarantees: ``state`` is not changed; the state returned holds the adapters, the optimizer's
    state, the step, the RNG key and every other entry (``extra["lora"]``'s scaling and layouts
    included): what a LoRA checkpoint needs, since the base is the model's own weights.
    ``join_base(*split_base(state))`` is ``state``."""
    if "lora" not in state.extra.keys() or "base" not in state.extra["lora"].keys():
        return state, None
    return state.replace(extra=state.extra.exclude(("lora", "base"))), state.extra["lora", "base"]


def join_base(state: TrainState, base: TensorDictBase | None) -> TrainState:
    """``state`` (from :func:`split_base`, or ``ft.load`` of a LoRA checkpoint) with the frozen
    ``base`` back in ``state.extra["lora", "base"]`` (``ft.params_of(model)`` of the model the
    adapters were trained on, laid out as the state is); ``base=None`` returns ``state``. A new
    state: ``state`` is not changed."""
    if base is None:
        return state
    if "lora" not in state.extra.keys():
        raise ValueError(
            "join_base(state, base): state holds no LoRA entry (state.extra['lora']); give the "
            "state of a LoRA run (lora.init_state, or ft.load of its checkpoint)."
        )
    entry = state.extra["lora"].clone(recurse=False)
    entry["base"] = base
    extra = state.extra.clone(recurse=False)
    extra["lora"] = entry
    return state.replace(extra=extra)


# -- helpers --------------------------------------------------------------------------------------


def _check_has_base(state: TrainState, who: str) -> None:
    if "base" not in state.extra["lora"].keys():
        raise ValueError(
            f"{who}: the LoRA state holds the adapters but not the frozen base (a LoRA "
            "checkpoint leaves it out: it is the model's own weights); put it back with "
            "ftrain.transforms.lora.join_base(state, ft.params_of(model))."
        )


def _delta(lora_b: torch.Tensor, lora_a: torch.Tensor, scaling: float, transposed) -> torch.Tensor:
    """The adapter's update ``scaling * B @ A`` laid out like its target's weight: ``(out, in)``,
    or ``(in, out)`` for a transposed (``Conv1D``) target."""
    delta = scaling * (lora_b @ lora_a)  # (out, r) @ (r, in) -> (out, in)
    return delta.T if bool(transposed) else delta


def _layout(module: nn.Module) -> tuple[bool, tuple[int, int]] | None:
    """``(fan_in_fan_out, (in, out))`` of a linear layer, None for any other module."""
    if isinstance(module, nn.Linear):
        return False, (module.in_features, module.out_features)
    # Hugging Face's Conv1D (GPT-2): a linear layer whose weight is stored (in, out); matched by
    # class name so that transformers stays optional.
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2:
        return True, tuple(module.weight.shape)  # type: ignore[return-value]
    return None


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    try:
        return get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern)


def _short(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def _suffix_hint(linears: dict[str, nn.Module]) -> str:
    first = next(iter(linears), "proj")
    return ".".join(first.split(".")[-2:])


def _check_base(lora: Lora, params: TensorDictBase) -> None:
    if not isinstance(params, TensorDictBase):
        raise TypeError(
            "lora.init_state(params, ...): params must be a TensorDict of the whole model "
            f"(ft.params_of(model)), got {type(params).__name__}."
        )
    flat = tree.to_flat(params)
    for path, transposed, (fan_in, fan_out) in zip(lora.targets, lora.fan_in_fan_out, lora.shapes):
        w = flat.get(f"{path}.weight")
        want = (fan_in, fan_out) if transposed else (fan_out, fan_in)
        if w is None or tuple(w.shape) != want:
            raise ValueError(
                f"lora.init_state(params, ...): params[{path + '.weight'!r}] is "
                f"{'missing' if w is None else tuple(w.shape)}, expected {want}; give the params "
                "of the model ft.lora was built from (ft.params_of(model))."
            )
