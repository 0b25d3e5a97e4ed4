"""A model's repeated blocks, and copies of a model whose blocks run differently.

Transforms that act per block (activation checkpointing recomputes each block, fsdp gathers each
block's parameters) never modify the user's module. They give ``ft.apply`` a *rewritten copy* to
run instead (see ``ftrain.step.Transform.rewrite``): :func:`replace_forwards` copies the modules on
the way from the root to each block, shallowly, and gives each block's copy a new ``forward``.
Every parameter, buffer and untouched submodule is shared with the original, so ``ft.apply``
places its tensors exactly as for the original; the original module and its submodules are left
as they were. Building the copy is plain Python that ``torch.compile`` traces, so a compiled step
stays one graph. The copies are made with ``ftrain.internals.module_tables``, the one module that
touches nn.Module's tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from ftrain.internals.module_tables import children, clear_hooks, copy_module, set_children

__all__ = ["find_blocks", "replace_forwards", "in_mode"]

# A function that, given the module to replace (as rewritten below it), returns its new forward.
MakeForward = Callable[[nn.Module], Callable]


def find_blocks(
    module: nn.Module, modules: Sequence[type[nn.Module]] | None = None
) -> list[nn.Module]:
    """The blocks of ``module``: where transformers keep their layers.

    With ``modules`` (module classes): every submodule that is an instance of one of them and is
    not inside another match (``module`` itself if it is one). Without: the children of the
    ``nn.ModuleList`` or ``nn.Sequential`` that holds the most parameters among those whose
    children are themselves composite modules (layers, not a list of Linear heads or embedding
    tables); ties go to the one found first, so an outer list of layers wins over a Sequential
    inside one layer. If no container has composite children, the one with the most children.
    """
    if modules is not None:
        types = tuple(modules)
        if isinstance(module, types):
            return [module]
        found: list[nn.Module] = []

        def visit(m: nn.Module) -> None:
            for child in m.children():
                if isinstance(child, types):
                    found.append(child)
                else:
                    visit(child)

        visit(module)
        return found
    containers = [m for m in module.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    composite = [
        m
        for m in containers
        if len(m) and all(next(c.children(), None) is not None for c in m.children())
    ]
    # Plain loops rather than max(key=...), which dynamo does not trace. A strict ">" keeps the
    # first of equals: the outer list of layers before any list inside one.
    best, best_size = None, -1
    for m in composite:
        size = sum(p.numel() for p in m.parameters())
        if size > best_size:
            best, best_size = m, size
    if best is None:
        for m in containers:
            if len(m) > best_size:
                best, best_size = m, len(m)
    return list(best) if best is not None else []


def replace_forwards(
    module: nn.Module, replacements: Sequence[tuple[nn.Module, MakeForward]]
) -> nn.Module:
    """A copy of ``module`` in which each ``(target, make)`` of ``replacements`` runs
    ``make(current)`` as its forward, where ``current`` is ``target`` with its own descendants
    already replaced: calling ``current(*args)`` inside the new forward runs what ``target`` ran.

    Targets are found by identity anywhere under ``module`` (``module`` itself included, replaced
    last). Each module on the way to a target is copied with :func:`copy_module` and its own
    submodule table; everything else is shared. Returns ``module`` itself when nothing is replaced.
    Neither ``module`` nor any submodule is modified.
    """
    targets = [t for t, _ in replacements]

    def contains(m: nn.Module) -> bool:
        return any(t is m for t in targets) or any(contains(c) for c in m.children())

    def visit(m: nn.Module) -> nn.Module:
        earlier = m.__dict__.get(_REPLACED)
        current = m
        if earlier is not None:  # a copy whose forward runs `inner`: rewrite inside `inner`
            make_earlier, inner = earlier
            new_inner = visit(inner)
            if new_inner is not inner:
                current = _replaced(m, make_earlier, new_inner)
                set_children(current, dict(children(new_inner)))
        else:
            table = children(m)
            changed = {
                name: visit(child)
                for name, child in table.items()
                if child is not None and contains(child)
            }
            if changed:
                current = copy_module(m)
                set_children(current, {**table, **changed})
        for target, make in replacements:
            if target is m:
                current = _replaced(current, make, current)
                clear_hooks(current)
        return current

    return visit(module)


# On our own copies (never a user's module): ``(make, inner)`` of a copy whose forward is
# ``make(inner)``. A later :func:`replace_forwards` rewrites inside ``inner`` and makes the forward
# again; otherwise the forward would still run the blocks as they were before (fsdp replaces the
# root's forward, and ft.checkpoint's rewrite comes after it).
_REPLACED = "_ftrain_replaced_forward"


def _replaced(module: nn.Module, make: MakeForward, inner: nn.Module) -> nn.Module:
    copy = copy_module(module)
    copy.__dict__["forward"] = make(inner)  # attributes of our own copy
    copy.__dict__[_REPLACED] = (make, inner)
    return copy


def in_mode(module: nn.Module, training: bool) -> nn.Module:
    """A copy of ``module`` in which it and every submodule have ``training`` set as given (what
    ``module.train(training)`` would do), sharing every tensor: the module itself and its flags
    are left as they are. A submodule shared by two parents is copied once."""
    copies: dict[int, nn.Module] = {}

    def visit(m: nn.Module) -> nn.Module:
        if id(m) in copies:
            return copies[id(m)]
        earlier = m.__dict__.get(_REPLACED)
        if earlier is not None:  # a copy whose forward runs `inner`: set the mode inside `inner`
            make, inner = earlier
            new_inner = visit(inner)
            new = copies[id(m)] = _replaced(m, make, new_inner)
            set_children(new, dict(children(new_inner)))
        else:
            new = copies[id(m)] = copy_module(m)
            set_children(
                new,
                {name: None if c is None else visit(c) for name, c in children(m).items()},
            )
        new.__dict__["training"] = training  # an attribute of our own copy
        return new

    return visit(module)
