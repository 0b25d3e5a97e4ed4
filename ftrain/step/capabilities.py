"""What transforms declare about themselves, and the one table of what does not combine.

A transform says what it does to the step in :meth:`ftrain.Transform.capabilities`: a mapping from
capability names (the sentences below) to a note (``""`` or a detail the messages quote). It never
names another transform: which declarations clash is written once, in :data:`RULES`, and the step
checks every pair of its transforms against it when it is built. The same declarations decide the
few things the step itself must know about its transforms (see :func:`forward_rank`,
:func:`replaces_engine`, :func:`reduces_in_backward`, :func:`reduced_after_backward`).

**Every capability is exclusive unless listed in** :data:`SHAREABLE`: two transforms declaring
the same one do not compose (``ft.autocast`` twice sets the precision twice). A transform of your
own that must be applied once declares a sentence of its own, e.g. ``{"adds gradient noise": ""}``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ftrain.step.transform import Transform

__all__ = [
    "COMPILES",
    "UNTRACEABLE",
    "TORCH_FUNC_GRADIENTS",
    "REPLACES_ENGINE",
    "SAVED_TENSOR_HOOKS",
    "STACKED_STATE",
    "SHARDED_STATE",
    "SHARDED_PARAMS",
    "SPLITS_MATRICES",
    "GATHERS_PARAMS",
    "REDUCES_IN_BACKWARD",
    "DATA_PARALLEL",
    "DATA_PARALLEL_OVER",
    "COMBINES_ROWS",
    "WEIGHS_ROWS",
    "SCALES_LOSS",
    "SETS_PRECISION",
    "RECOMPUTES",
    "SPLITS_BATCH",
    "HOST_OPTIMIZER",
    "PIPELINES",
    "SHAREABLE",
    "Rule",
    "RULES",
    "check_combination",
    "check_engines",
    "forward_rank",
    "replaces_engine",
    "reduces_in_backward",
    "reduced_after_backward",
]

# -- what a transform does (each sentence reads "ft.<name> ...") ------------------------------------
COMPILES = "compiles the step"
UNTRACEABLE = "cannot be traced by torch.compile"  # note: why, and what to do instead
TORCH_FUNC_GRADIENTS = "computes gradients with torch.func"
REPLACES_ENGINE = "replaces the gradient engine"
SAVED_TENSOR_HOOKS = "uses saved-tensor hooks"
STACKED_STATE = "stacks several members along the state's first dimension"
SHARDED_STATE = "lays the state out across processes"
SHARDED_PARAMS = "splits the params across processes"
SPLITS_MATRICES = "splits weight matrices across processes"  # its model rewrite runs innermost
GATHERS_PARAMS = "gathers parameter shards during the forward"  # its rewrite runs next
# its reduce hook then changes only the gradients the engine left local (reweighted ones) and
# those of params another transform splits over the processes (tp's, whole over dp)
REDUCES_IN_BACKWARD = "reduces gradients across processes during backward"
DATA_PARALLEL = "splits the batch across processes"  # note: over which ranks
DATA_PARALLEL_OVER = "needs the batch split over its mesh's 'dp' ranks"  # note: those ranks
COMBINES_ROWS = "sums the losses of several groups of rows"
WEIGHS_ROWS = "gives every row of the batch the same weight"
SCALES_LOSS = "scales the loss"
SETS_PRECISION = "sets the forward's precision"
RECOMPUTES = "recomputes activations in backward"
SPLITS_BATCH = "splits the batch into micro-batches"  # note: into how many
HOST_OPTIMIZER = "keeps the optimizer state in host memory"  # note: what else moves there
PIPELINES = "runs the model's stages on several processes"  # its forward hook runs innermost

# declared by several transforms of one step without conflict
SHAREABLE = frozenset(
    {
        UNTRACEABLE,
        TORCH_FUNC_GRADIENTS,
        SAVED_TENSOR_HOOKS,
        SHARDED_STATE,
        SHARDED_PARAMS,
        COMBINES_ROWS,
        WEIGHS_ROWS,
        DATA_PARALLEL_OVER,  # by transforms splitting one mesh's model (tp and pp): a rule below
    }
)


class Rule(NamedTuple):
    """Two capabilities that do not combine: ``why`` they clash and the ``fix`` (``{a}`` and
    ``{b}`` stand for the transforms declaring ``a`` and ``b``). With ``clash``, only when it
    returns True for the two notes."""

    a: str
    b: str
    why: str
    fix: str
    clash: Callable[[str, str], bool] | None = None


RULES: tuple[Rule, ...] = (
    Rule(
        COMPILES,
        UNTRACEABLE,
        "dynamo cannot trace what {b} does.",
        "Leave out {a} and run {b} eagerly.",
    ),
    Rule(
        TORCH_FUNC_GRADIENTS,
        SAVED_TENSOR_HOOKS,
        "torch.func refuses saved-tensor hooks.",
        "Leave out {b} (with ft.checkpoint: bound memory with ft.accumulate instead; with "
        "ft.shard: use 'ddp', 'zero1' or 'zero2'), or leave out {a}.",
    ),
    Rule(
        TORCH_FUNC_GRADIENTS,
        SHARDED_PARAMS,
        "torch.func differentiates whole params on each process, not pieces of them.",
        "Leave out {b}, or train without {a}.",
    ),
    Rule(
        STACKED_STATE,
        SHARDED_STATE,
        "the members are stacked along the first dimension of every state tensor, which the "
        "layout across processes would split.",
        "Replicate the members: ft.shard(step, 'ddp').",
    ),
    Rule(
        DATA_PARALLEL_OVER,
        DATA_PARALLEL,
        "the batch must be split over the 'dp' dimension of {a}'s mesh.",
        "Fix: {b}(step, ..., mesh=mesh['dp']), with the mesh of {a}.",
        clash=lambda over, ranks: over != ranks,
    ),
    Rule(
        DATA_PARALLEL_OVER,
        DATA_PARALLEL_OVER,
        "both split the model over one mesh, whose 'dp' ranks {a} and {b} must share.",
        "Build {a} and {b} on the same mesh (ft.distributed.pipeline.pp_mesh).",
        clash=lambda mine, theirs: mine != theirs,
    ),
)


def _name(t: Transform) -> str:
    return f"ft.{t.name}"


def _said(t: Transform, capability: str) -> str:
    note = t.capabilities()[capability]
    return f"{_name(t)} {capability}" + (f" ({note})" if note else "")


def _conflict(x: Transform, y: Transform, rule: Rule) -> ValueError:
    names = {"a": _name(x), "b": _name(y)}
    return ValueError(
        f"{_said(x, rule.a)} and {_said(y, rule.b)}: they do not compose, in either order; "
        f"{rule.why.format(**names)} {rule.fix.format(**names)}"
    )


def _twice(x: Transform, y: Transform, capability: str) -> ValueError:
    if x.name == y.name:  # one transform (in any of its classes, e.g. fp16 autocast)
        settings = [t.capabilities()[capability] for t in (x, y)]
        given = f": {settings[0]}, then {settings[1]}" if all(settings) else ""
        return ValueError(
            f"{_name(x)} was applied twice{given} (it {capability}); apply it once, with the "
            "settings you want."
        )
    return ValueError(
        f"{_said(x, capability)}, and so does {_name(y)}: they do not compose, in either order. "
        "Apply one of them."
    )


def check_combination(transforms: Sequence[Transform]) -> None:
    """Raise ``ValueError`` naming both transforms and the fix when two of ``transforms`` declare
    capabilities that do not combine: the same exclusive one, or a pair in :data:`RULES`."""
    declared = [(t, t.capabilities()) for t in transforms]
    for i, (x, cx) in enumerate(declared):
        for y, cy in declared[i + 1 :]:
            for rule in RULES:  # first: a rule says why the two clash, not only that they do
                for p, cp, q, cq in ((x, cx, y, cy), (y, cy, x, cx)):
                    if rule.a in cp and rule.b in cq:
                        if rule.clash is None or rule.clash(cp[rule.a], cq[rule.b]):
                            raise _conflict(p, q, rule)
            for cap in sorted(cx.keys() & cy.keys() - SHAREABLE):
                raise _twice(x, y, cap)


def check_engines(changed: Sequence[Transform]) -> None:
    """``changed``: the transforms whose ``engine`` hook changed what the engine computes (one
    that only hands the default engine a gradient sink or reducer, ``ft.offload``'s copies or
    ``ft.shard``'s buckets, is not among them: a replaced engine drops it and the gradients are
    the same once the step's reduce hooks have run). One that declares
    ``REPLACES_ENGINE`` computes the gradients its own way, so no other may change the engine
    (in either order: a later one could drop what the replaced engine does, e.g. DP-SGD's
    clipping, and keep the rest)."""
    for t in changed:
        if REPLACES_ENGINE in t.capabilities():
            for other in changed:
                if other is not t:
                    raise ValueError(
                        f"{_said(t, REPLACES_ENGINE)} and {_name(other)} changes it too: they do "
                        "not compose, in either order. Leave one of them out."
                    )


def _declares(transforms: Sequence[Transform], capability: str) -> bool:
    return any(capability in t.capabilities() for t in transforms)


def forward_rank(t: Transform) -> int:
    """Where ``t``'s forward hook sits among a step's, whatever the order they were applied in
    (lower: closer to the loss function). Splitting the matrices comes first, so every other
    rewrite sees the tensor-parallel model; gathering shards next, so a block that activation
    checkpointing recomputes gathers its parameters again. The rest keep the order applied.
    Innermost of all, a pipeline's: its hook runs each stage (and the loss) inside every other
    transform's forward hook, so they act on the stages as they would on the whole model."""
    caps = t.capabilities()
    if PIPELINES in caps:
        return -1
    return 0 if SPLITS_MATRICES in caps else 1 if GATHERS_PARAMS in caps else 2


def replaces_engine(transforms: Sequence[Transform]) -> bool:
    """Whether a transform computes the gradients its own way (the engine may see all
    micro-batches at once)."""
    return _declares(transforms, REPLACES_ENGINE)


def reduces_in_backward(transforms: Sequence[Transform]) -> bool:
    """Whether gradients are reduced across processes while backward runs."""
    return _declares(transforms, REDUCES_IN_BACKWARD)


def reduced_after_backward(transforms: Sequence[Transform], reducing: Sequence[Transform]) -> bool:
    """Whether a transform may change the engine's gradients after backward: one in
    ``reducing`` (those with a ``reduce`` hook) or one splitting the batch or the model across
    processes, unless it declares ``REDUCES_IN_BACKWARD``, whose ``reduce`` hook changes only
    the gradients the engine left local (``ftrain.step.BackwardPlan.reweight``)."""
    return any(
        t in reducing or _declares([t], DATA_PARALLEL) or _declares([t], DATA_PARALLEL_OVER)
        for t in transforms
        if not _declares([t], REDUCES_IN_BACKWARD)
    )


def notes(transforms: Sequence[Transform], capability: str) -> list[tuple[Transform, str]]:
    """The transforms declaring ``capability``, each with its note."""
    return [(t, t.capabilities()[capability]) for t in transforms if capability in t.capabilities()]
