"""``Step.explain()``: the resolved pipeline of a step, phase by phase.

Each row names a hook, the transforms whose hook acts there in the order they run, and whether
it runs eagerly or inside ``torch.compile``. It is worked out from what the step resolved when it
was built (which hooks each transform overrides, which build-time hooks changed something, the
order the capabilities impose), so it cannot disagree with what a call does.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ftrain.step import capabilities

__all__ = ["Row", "rows", "explain"]


class Row(NamedTuple):
    """One hook of a resolved step."""

    phase: str  # build, set-up, forward, grad, reduce, update
    hook: str  # the Transform method (or the step's own part, e.g. "update")
    transforms: tuple[str, ...]  # their names, in the order their hooks run
    runs: str  # "once" (when built), "eager", "compiled" or "compiled per micro-batch"


def rows(step: Any) -> list[Row]:
    """The rows of :func:`explain` for ``step`` (an ``ft.Step``: what its ``resolved`` holds), in
    the order the hooks run (build first, then one call)."""
    hooks = step.resolved
    ts = step.transforms
    compiled = any(capabilities.COMPILES in t.capabilities() for t in ts)
    traced = [t for stage, t in hooks.wrap if stage == "traced"]
    looped = compiled and step.piecewise and not traced
    inside = "compiled" if compiled else "eager"
    piece = "compiled per micro-batch" if looped else inside

    def names(transforms) -> tuple[str, ...]:
        return tuple(t.name for t in transforms)

    def wraps(stage: str) -> tuple[str, ...]:  # outermost first: the order their code starts
        return names(reversed([t for s, t in hooks.wrap if s == stage]))

    return [
        Row("build", "capabilities", names(t for t in ts if t.capabilities()), "once"),
        Row("build", "optimizer", names(hooks.optimizer), "once"),
        Row("build", "engine", names(hooks.engine), "once"),
        Row("set-up", "init", names(hooks.init), "eager"),
        Row("set-up", "wrap(eager)", wraps("eager"), "eager"),
        Row("set-up", "wrap(compile)", wraps("compile"), "eager"),
        Row("set-up", "wrap(traced)", tuple(traced and wraps("traced")), inside),
        Row("forward", "split", names(hooks.split), "eager" if looped else inside),
        Row("forward", "loss_scale", names(hooks.loss_scale), "eager" if looped else inside),
        Row("forward", "forward", names(reversed(hooks.forward)), piece),
        Row("grad", "engine", (repr(hooks.gradient_engine),), piece),
        Row("reduce", "reduce", names(hooks.reduce), inside),
        Row("update", "gradients", names(hooks.gradients), inside),
        Row("update", "update", names(hooks.optimizer) or ("optimizer",), inside),
    ]


def explain(step: Any) -> str:
    """A table of :func:`rows`: one line per hook, in the order they run."""
    lines, table = [repr(step)], rows(step)
    width = max(len(r.hook) for r in table)
    for r in table:
        who = ", ".join(r.transforms) if r.transforms else "-"
        lines.append(f"  {r.phase:<8} {r.hook:<{width}}  {r.runs:<24} {who}")
    return "\n".join(lines)
