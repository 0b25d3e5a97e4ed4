"""Tensor-parallel plans: which linear layers split by columns and which by rows.

A *plan* maps module-path patterns (``fnmatch`` syntax over ``model.named_modules()`` names, e.g.
``"blocks.*.attn.qkv"``) to a style:

* :class:`Colwise` (Megatron's column-parallel linear): the output features are split across the
  ``tp`` processes. ``nn.Linear`` weight ``(out, in)`` is ``Shard(0)``, its bias ``Shard(0)``.
  ``chunks=k`` is for fused projections (GPT's ``qkv`` holds q, k and v stacked): each of the k
  stacked blocks is split on its own, so every process holds whole heads of q, k and v.
* :class:`Rowwise` (row-parallel linear): the input features are split; the outputs of the
  processes are summed. Weight ``Shard(1)``, bias whole (added once, after the sum).

* :class:`Divide` (no parameters): integer attributes of a module that count what each process
  now holds a share of, divided by the tp size in the copy the forward runs (an attention's head
  count, e.g. ``Divide("n_head")``). Models that infer heads from the input width need none.
* :class:`SequenceParallel` (no parameters): the modules that run on sequence slices under
  ``ft.tensor_parallel(..., sequence_parallel=True)`` (the blocks, e.g. ``"blocks.*"``); ignored
  otherwise. See ``ftrain.distributed.tensor_parallel.sequence_region``.

Hugging Face ``Conv1D`` (GPT-2) stores its weight transposed, ``(in, out)``: the same style
splits the other dimension, which :func:`resolve_plan` handles. Parameters that no pattern names
(embeddings, norms) stay whole on every process.

:func:`resolve_plan` turns a plan and a model into a placement per parameter and checks it
against the model and the ``tp`` size, so a wrong plan is an error that names the pattern or the
dimension when the step is built, never a silent mis-split.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping, Sequence

import torch
from torch import nn

__all__ = [
    "Colwise",
    "Rowwise",
    "Divide",
    "SequenceParallel",
    "Split",
    "match_plan",
    "resolve_divisions",
    "resolve_plan",
    "gpt_plan",
    "hf_gpt2_plan",
    "hf_llama_plan",
    "check_mesh_shape",
    "is_conv1d",
    "plan_for",
    "local_piece",
    "join_pieces",
]


@dataclasses.dataclass(frozen=True)
class Colwise:
    """Column-parallel linear: output features split across ``tp`` (``chunks`` fused blocks each
    split on their own)."""

    chunks: int = 1


@dataclasses.dataclass(frozen=True)
class Rowwise:
    """Row-parallel linear: input features split across ``tp``, outputs summed."""


@dataclasses.dataclass(frozen=True)
class Divide:
    """Integer attributes of a module divided by the tp size while it runs tensor-parallel (a
    head count: each process runs ``n_head / tp`` heads). The module is not modified: the forward
    runs a copy."""

    attrs: tuple[str, ...]

    def __init__(self, *attrs: str):
        if not attrs or not all(isinstance(a, str) and a for a in attrs):
            raise ValueError(
                f"Divide{attrs!r}: name one or more attributes, e.g. Divide('n_head')."
            )
        object.__setattr__(self, "attrs", tuple(attrs))


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """The modules a pattern names run on this process's slice of the sequence under sequence
    parallelism: the hidden states (the first argument) are split along dim 1 entering the first
    of them (in ``named_modules`` order, outermost matches only) and gathered leaving the last.
    Name consecutive blocks that hold whole column/row pairs (``"blocks.*"``)."""


@dataclasses.dataclass(frozen=True)
class Split:
    """Where one parameter lives under tensor parallelism: ``dim`` is the split dimension of the
    stored tensor (None: whole on every process); ``chunks`` fused blocks along ``dim`` are each
    split on their own."""

    dim: int | None
    chunks: int = 1


_STYLES = (Colwise, Rowwise, Divide, SequenceParallel)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (a linear whose weight is stored
    ``(in, out)``), checked by name so that transformers stays an optional dependency."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _splits(name: str, module: nn.Module, style, tp: int) -> dict[str, Split]:
    if not (isinstance(module, nn.Linear) or is_conv1d(module)):
        raise ValueError(
            f"tensor parallel plan: {name!r} is a {type(module).__name__}; Colwise/Rowwise apply "
            "to nn.Linear (or transformers' Conv1D) only. Name the linear layers in the plan."
        )
    transposed = is_conv1d(module)
    w = module.weight
    out_dim = 1 if transposed else 0
    in_dim = 1 - out_dim
    if isinstance(style, Colwise):
        dim, chunks, what = out_dim, style.chunks, "output features"
    else:
        dim, chunks, what = in_dim, 1, "input features"
    size = w.shape[dim]
    if size % (chunks * tp) != 0:
        raise ValueError(
            f"tensor parallel plan: {name!r} has {size} {what}"
            + (f" in {chunks} fused blocks" if chunks > 1 else "")
            + f", not divisible by {chunks * tp} (tp={tp}"
            + (f" x chunks={chunks}" if chunks > 1 else "")
            + "). Fix: choose a tp size that divides the layer's width (and the head count)."
        )
    out = {f"{name}.weight" if name else "weight": Split(dim, chunks)}
    if getattr(module, "bias", None) is not None:
        bias_split = Split(0, chunks) if isinstance(style, Colwise) else Split(None)
        out[f"{name}.bias" if name else "bias"] = bias_split
    return out


def match_plan(model: nn.Module, plan: Mapping[str, object]) -> list[tuple[str, object]]:
    """``(module path, style)`` for every module a pattern of ``plan`` names (a module may have
    a linear style, a ``Divide`` and a ``SequenceParallel``).

    Raises ``TypeError`` for a style that is not ``Colwise``/``Rowwise``/``Divide``/
    ``SequenceParallel`` and ``ValueError`` when a pattern names no module or two patterns of one
    kind (linear styles, ``Divide``, ``SequenceParallel``) name the same module."""
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(
            f"tensor parallel plan: expected a non-empty mapping of module-path patterns to "
            f"Colwise()/Rowwise()/Divide(...), got {plan!r}. See ftrain.distributed.tensor_parallel.plans.gpt_plan()."
        )
    modules = dict(model.named_modules())
    styles: list[tuple[str, object]] = []
    owner: dict[tuple[str, type], str] = {}
    for pattern, style in plan.items():
        if not isinstance(style, _STYLES):
            raise TypeError(
                f"tensor parallel plan[{pattern!r}] = {style!r}: expected Colwise(), Rowwise(), "
                "Divide('attr', ...) or SequenceParallel()."
            )
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            sample = ", ".join(n for n in list(modules)[1:6])
            raise ValueError(
                f"tensor parallel plan: pattern {pattern!r} names no module of "
                f"{type(model).__name__} (module paths look like: {sample}, ...). Fix the pattern "
                "(fnmatch syntax over model.named_modules() names)."
            )
        kind = Colwise if isinstance(style, (Colwise, Rowwise)) else type(style)
        for name in names:
            if (name, kind) in owner:
                raise ValueError(
                    f"tensor parallel plan: {name!r} is named by both {owner[name, kind]!r} and "
                    f"{pattern!r}; give each module one style."
                )
            owner[name, kind] = pattern
            styles.append((name, style))
    return styles


def resolve_plan(model: nn.Module, plan: Mapping[str, object], tp: int) -> dict[str, Split]:
    """The :class:`Split` of every parameter of ``model`` (keys as ``named_parameters`` gives
    them; parameters no pattern names are ``Split(None)``, whole).

    Raises ``ValueError`` when a pattern names no module, a style is not ``Colwise``/``Rowwise``/
    ``Divide``, two patterns name the same module, a named module is not a linear layer, or a
    split dimension is not divisible by ``tp`` (times ``chunks``)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"resolve_plan(tp={tp!r}): the tensor-parallel size must be an int >= 1.")
    modules = dict(model.named_modules())
    splits: dict[str, Split] = {name: Split(None) for name, _ in model.named_parameters()}
    for name, style in match_plan(model, plan):
        if isinstance(style, (Colwise, Rowwise)):
            splits.update(_splits(name, modules[name], style, tp))
    resolve_divisions(model, plan, tp)  # the divided attributes must divide too
    return splits


def resolve_divisions(model: nn.Module, plan: Mapping[str, object], tp: int) -> dict[str, dict]:
    """Module path -> ``{attribute: value / tp}`` for the ``Divide`` entries of ``plan``; a
    ``ValueError`` names an attribute that is missing, not an int, or not divisible by ``tp``."""
    modules = dict(model.named_modules())
    out: dict[str, dict] = {}
    for name, style in match_plan(model, plan):
        if not isinstance(style, Divide):
            continue
        values = {}
        for attr in style.attrs:
            v = getattr(modules[name], attr, None)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(
                    f"tensor parallel plan: Divide({attr!r}) on {name!r}: the module has no int "
                    f"attribute {attr!r} (got {v!r}). Name an attribute that counts heads."
                )
            if v % tp:
                raise ValueError(
                    f"tensor parallel plan: {name}.{attr} = {v} is not divisible by tp={tp}. Fix: "
                    f"choose a tp size that divides {v}."
                )
            values[attr] = v // tp
        out[name] = values
    return out


def gpt_plan(*, vocab_parallel: bool = False) -> dict[str, object]:
    """The plan for ``ftrain.models.GPT``: attention ``qkv`` by columns (three fused blocks, so
    each process holds whole heads; ``n_head`` divided), its ``proj`` by rows; MLP ``fc`` by columns, ``proj`` by
    rows. Needs ``n_head`` and ``4 * d_model`` divisible by the tp size. The blocks run on
    sequence slices under ``sequence_parallel=True`` (``SequenceParallel``).

    ``vocab_parallel=True`` also splits ``lm_head`` by columns (a GPT with
    ``tie_weights=False`` and a vocabulary divisible by the tp size): the model then returns
    this process's vocabulary slice of the logits ``(B, T, V / tp)``, never gathered; train it
    with ``ftrain.distributed.vocab_parallel_cross_entropy(logits, targets, tp.group)``."""
    head = {"lm_head": Colwise()} if vocab_parallel else {}
    return head | {
        "blocks.*": SequenceParallel(),
        "blocks.*.attn": Divide("n_head"),
        "blocks.*.attn.qkv": Colwise(chunks=3),
        "blocks.*.attn.proj": Rowwise(),
        "blocks.*.mlp.fc": Colwise(),
        "blocks.*.mlp.proj": Rowwise(),
    }


def hf_gpt2_plan() -> dict[str, object]:
    """The plan for Hugging Face GPT-2 (``GPT2LMHeadModel``, ``Conv1D`` layers whose weights are
    stored transposed): ``c_attn`` by columns (q, k, v fused; ``num_heads`` and ``split_size``
    divided), ``attn.c_proj`` by rows,
    ``mlp.c_fc`` by columns, ``mlp.c_proj`` by rows; the blocks run on sequence slices under
    ``sequence_parallel=True``."""
    return {
        "transformer.h.*": SequenceParallel(),
        "transformer.h.*.attn": Divide("num_heads", "split_size"),
        "transformer.h.*.attn.c_attn": Colwise(chunks=3),
        "transformer.h.*.attn.c_proj": Rowwise(),
        "transformer.h.*.mlp.c_fc": Colwise(),
        "transformer.h.*.mlp.c_proj": Rowwise(),
    }


def hf_llama_plan() -> dict[str, object]:
    """The plan for Hugging Face Llama (``LlamaForCausalLM``): q, k, v by columns, ``o_proj`` by
    rows; ``gate_proj`` and ``up_proj`` by columns, ``down_proj`` by rows. Needs both the query
    and the key/value head counts divisible by the tp size. Llama's attention infers its head
    count from the projections' width, so nothing is divided.

    No ``SequenceParallel`` region: Llama's attention reshapes q, k and v by the sequence length
    of its input, which sequence parallelism splits, so ``sequence_parallel=True`` is refused."""
    return {
        "model.layers.*.self_attn.[qkv]_proj": Colwise(),
        "model.layers.*.self_attn.o_proj": Rowwise(),
        "model.layers.*.mlp.gate_proj": Colwise(),
        "model.layers.*.mlp.up_proj": Colwise(),
        "model.layers.*.mlp.down_proj": Rowwise(),
    }


def plan_for(model: nn.Module) -> dict[str, object]:
    """The provided plan for ``model``: :func:`gpt_plan` for ``ftrain.models.GPT``,
    :func:`hf_gpt2_plan` / :func:`hf_llama_plan` for a Hugging Face model whose config's
    ``model_type`` is ``gpt2`` / ``llama``; for another model a ``ValueError`` that says how to
    write one."""
    from ftrain.models import GPT

    if isinstance(model, GPT):
        return gpt_plan()
    kind = getattr(getattr(model, "config", None), "model_type", None)
    plans = {"gpt2": hf_gpt2_plan, "llama": hf_llama_plan}
    if kind in plans:
        return plans[kind]()
    raise ValueError(
        f"tensor parallel: no provided plan for {type(model).__name__} (model_type {kind!r}); "
        f"plans exist for ftrain's GPT and Hugging Face {sorted(plans)}. Write one: module-path "
        "patterns -> Colwise()/Rowwise()/Divide(...) (docs/tensor-parallel.md), and pass it to "
        "ft.tensor_parallel(model, plan, mesh)."
    )


def check_mesh_shape(shape: Mapping[str, int], world_size: int) -> dict[str, int]:
    """``shape`` (mesh dimension name -> size, e.g. ``{"dp": 2, "tp": 2}``) if its sizes are
    positive ints whose product is ``world_size``; else a ``ValueError`` that says so."""
    sizes = dict(shape)
    if not sizes or any(
        isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes.values()
    ):
        raise ValueError(f"mesh shape {sizes!r}: each dimension must be an int >= 1.")
    total = 1
    for s in sizes.values():
        total *= s
    if total != world_size:
        dims = " x ".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(
            f"mesh {dims} has {total} processes but the world has {world_size}. Fix: launch "
            f"{total} processes (torchrun --nproc_per_node {total}) or choose sizes whose product "
            f"is {world_size}."
        )
    return sizes


def local_piece(t: torch.Tensor, split: Split, rank: int, tp: int) -> torch.Tensor:
    """The part of the whole tensor ``t`` that process ``rank`` of ``tp`` holds under ``split``
    (a view; ``t`` itself when whole). With ``chunks=k`` it is the ``rank``-th slice of each of
    the k fused blocks, concatenated (so q, k and v heads stay together)."""
    if split.dim is None:
        return t
    blocks = t.chunk(split.chunks, dim=split.dim)
    pieces = [b.chunk(tp, dim=split.dim)[rank] for b in blocks]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=split.dim)


def join_pieces(pieces: Sequence[torch.Tensor], split: Split) -> torch.Tensor:
    """The whole tensor from the pieces of every process, in rank order: the inverse of
    :func:`local_piece` (``pieces[0]`` when whole)."""
    if split.dim is None:
        return pieces[0]
    per_rank = [p.chunk(split.chunks, dim=split.dim) for p in pieces]
    blocks = [torch.cat([r[c] for r in per_rank], dim=split.dim) for c in range(split.chunks)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=split.dim)
