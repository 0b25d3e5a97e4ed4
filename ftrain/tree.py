"""Flat views of TensorDict pytrees.

Every multi-tensor kernel (``torch._foreach_*``) wants a list of tensors; every public object is a
nested ``TensorDict``. These helpers convert between the two, always in the order of
``td.keys(include_nested=True, leaves_only=True)``, so a list built from one tree can be put back
into any tree with the same keys.

:func:`flatten` returns the leaves and a :class:`TreeDef`, the tree's key structure. Tree
definitions are interned (one object per structure, in eager mode), so what is derived from a
structure (dotted paths, where a sub-tree's leaves start and stop) is computed once and then
looked up. ``TreeDef.unflatten`` builds a new tree; ``TreeDef.rebuild`` keeps the containers of
an old tree whose tensors did not change (what a donated, in-place step needs).

They run several times on every step, so plain ``TensorDict`` trees take a fast path that walks
the underlying dicts directly (several times cheaper than the generic iterators); other TensorDict
types go through the public API and come back as plain nested TensorDicts. This is the one module
that touches tensordict's private attributes (``_tensordict``, ``_batch_size``, ``_new_unsafe``,
``_from_tensordict``); the public equivalents are ``td.items()``, ``td.batch_size`` and the
constructors, each several times slower per call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from tensordict import TensorDict, TensorDictBase

__all__ = [
    "TreeDef",
    "flatten",
    "structure",
    "leaves",
    "first_leaf",
    "paths",
    "unflatten",
    "from_flat",
    "to_flat",
    "new_tensorclass",
    "compiling",
]

T = TypeVar("T")

SEP = "."  # module paths never contain a dot inside one name, so "a.b.c" splits unambiguously
_EMPTY_SIZE = torch.Size([])
_GENERIC = "generic"  # marks a sub-tree that is not a plain TensorDict (rebuilt through from_flat)


def _plain(td) -> bool:
    return type(td) is TensorDict and not td._batch_size


def compiling() -> bool:
    """Whether dynamo is tracing: then no module state may be read or written for caching (dynamo
    would guard on it and recompile when it changes)."""
    return torch.compiler.is_compiling()


class TreeDef:
    """The key structure of a nested TensorDict, without its tensors.

    ``sig`` is a tuple with one entry per key, in order: the key itself for a tensor leaf,
    ``(key, child_sig)`` for a plain sub-TensorDict, ``(key, "generic", paths)`` for any other
    TensorDict type. Two trees with equal ``sig`` have the same keys in the same order, so leaf
    lists of one fit the other. In eager mode :func:`flatten` returns one shared object per
    ``sig``; compare with ``==`` (identity is the fast path).
    """

    __slots__ = (
        "sig",
        "n",
        "_entries",
        "_paths",
        "_spans",
        "_children",
        "_index",
        "_derived",
        "__weakref__",
    )

    def __init__(self, sig: tuple):
        self.sig = sig
        entries = []
        n = 0
        for e in sig:
            if isinstance(e, str):
                entries.append((e, None, 1))
                n += 1
            elif e[1] == _GENERIC:
                entries.append((e[0], e[2], len(e[2])))
                n += len(e[2])
            else:
                child = _intern(e[1])
                entries.append((e[0], child, child.n))
                n += child.n
        self._entries = tuple(entries)
        self.n = n  # number of leaves
        self._paths: tuple[str, ...] | None = None
        self._spans: dict[str, tuple[int, int]] | None = None
        self._children: dict[str, TreeDef] = {}
        self._index: dict[str, int] | None = None
        self._derived: dict[Callable, object] = {}

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, TreeDef) and self.sig == other.sig)

    def __hash__(self) -> int:
        return hash(self.sig)

    def __repr__(self) -> str:
        return (
            f"TreeDef({self.n} leaves: {', '.join(self.paths[:4])}{', ...' if self.n > 4 else ''})"
        )

    @property
    def paths(self) -> tuple[str, ...]:
        """The dotted key of every leaf, in leaf order."""
        if self._paths is None:
            out = []
            for key, child, _ in self._entries:
                if child is None:
                    out.append(key)
                else:
                    sub = child if isinstance(child, tuple) else child.paths
                    out.extend(key + SEP + p for p in sub)
            self._paths = tuple(out)
        return self._paths

    def span(self, key: str) -> tuple[int, int]:
        """``(start, stop)``: where the leaves under top-level ``key`` sit in the leaf list."""
        if self._spans is None:
            spans, i = {}, 0
            for k, _, size in self._entries:
                spans[k] = (i, i + size)
                i += size
            self._spans = spans
        try:
            return self._spans[key]
        except KeyError:
            raise KeyError(
                f"the tree has no key {key!r}; its keys are {[e[0] for e in self._entries]}"
            ) from None

    def child(self, key: str) -> TreeDef:
        """The structure of the sub-tree under top-level ``key``."""
        got = self._children.get(key)
        if got is None:
            for k, child, _ in self._entries:
                if k == key:
                    if child is None:
                        raise KeyError(f"{key!r} is a tensor, not a sub-tree")
                    got = child if isinstance(child, TreeDef) else _from_paths(child)
                    break
            else:
                raise KeyError(
                    f"the tree has no key {key!r}; its keys are {[e[0] for e in self._entries]}"
                )
            self._children[key] = got
        return got

    def index(self, path: str) -> int:
        """Position of the leaf with dotted key ``path`` in the leaf list."""
        if self._index is None:
            self._index = {p: i for i, p in enumerate(self.paths)}
        return self._index[path]

    def derived(self, fn: Callable[[TreeDef], T]) -> T:
        """``fn(self)`` for a pure function ``fn`` of the structure, computed once per structure
        and function (like the paths above: a tree definition never changes). While dynamo
        traces, computed afresh."""
        if compiling():
            return fn(self)
        if fn not in self._derived:
            self._derived[fn] = fn(self)
        return self._derived[fn]  # type: ignore[return-value]

    def unflatten(self, values: Sequence[torch.Tensor]) -> TensorDict:
        """A new TensorDict with this structure holding ``values`` (in leaf order, no copies)."""
        if len(values) != self.n:
            raise ValueError(
                f"unflatten: {len(values)} tensors for a tree of {self.n} leaves "
                f"({', '.join(self.paths[:3])}{', ...' if self.n > 3 else ''})."
            )
        return self._build(values, 0)

    def rebuild(self, values: Sequence[torch.Tensor], like: TensorDictBase) -> TensorDictBase:
        """Like :meth:`unflatten`, but every sub-tree of ``like`` (a tree of this structure) whose
        leaves are all, by identity, the given tensors is reused as it is instead of rebuilt; if
        nothing changed, ``like`` itself comes back. For in-place (donated) updates, where most
        tensors stay the same objects. The result shares containers with ``like``."""
        if len(values) != self.n:
            raise ValueError(f"rebuild: {len(values)} tensors for a tree of {self.n} leaves.")
        if compiling() or not _plain(like):
            return self._build(values, 0)
        return self._reuse(values, 0, like)

    def _reuse(self, values: Sequence[torch.Tensor], i: int, like: TensorDict) -> TensorDict:
        old = like._tensordict
        src, same = {}, len(old) == len(self._entries)
        for key, child, size in self._entries:
            was = old.get(key)
            if child is None:
                src[key] = v = values[i]
            elif isinstance(child, TreeDef) and was is not None and _plain(was):
                src[key] = v = child._reuse(values, i, was)
            elif isinstance(child, TreeDef):
                src[key] = v = child._build(values, i)
            else:
                src[key] = v = from_flat(dict(zip(child, values[i : i + size])))
            same = same and v is was
            i += size
        if same:
            return like
        return TensorDict._new_unsafe(src, batch_size=_EMPTY_SIZE, nested=False)

    def _build(self, values: Sequence[torch.Tensor], i: int) -> TensorDict:
        src = {}
        for key, child, size in self._entries:
            if child is None:
                src[key] = values[i]
            elif isinstance(child, TreeDef):
                src[key] = child._build(values, i)
            else:
                src[key] = from_flat(dict(zip(child, values[i : i + size])))
            i += size
        if compiling():
            return TensorDict(src, batch_size=_EMPTY_SIZE)
        return TensorDict._new_unsafe(src, batch_size=_EMPTY_SIZE, nested=False)


@functools.lru_cache(maxsize=4096)
def _interned(sig: tuple) -> TreeDef:
    """One TreeDef per signature (a tuple of strings: an immutable value), so that what is
    derived from a structure is computed once; bounded, least recently used dropped first."""
    return TreeDef(sig)


def _intern(sig: tuple) -> TreeDef:
    if compiling():  # never touch module state while dynamo traces: it would guard on it
        return TreeDef(sig)
    return _interned(sig)


def _sig(d: dict, out: list) -> tuple:
    entries = []
    for k, v in d.items():
        if isinstance(v, torch.Tensor):
            out.append(v)
            entries.append(k)
        elif _plain(v):
            entries.append((k, _sig(v._tensordict, out)))
        else:
            ps = tuple(paths(v))
            out.extend(v.values(include_nested=True, leaves_only=True))
            entries.append((k, _GENERIC, ps))
    return tuple(entries)


def _from_paths(ps: tuple[str, ...]) -> TreeDef:
    """The structure :func:`from_flat` gives to a tree with these dotted paths."""
    return structure(from_flat({p: torch.empty(0) for p in ps}))


def flatten(td: TensorDictBase) -> tuple[list[torch.Tensor], TreeDef]:
    """``(leaves, treedef)``: the leaf tensors of ``td`` in key order and its structure.

    ``treedef.unflatten(leaves)`` rebuilds an equal tree (as plain nested TensorDicts).
    """
    out: list[torch.Tensor] = []
    if _plain(td):
        sig = _sig(td._tensordict, out)
        return out, _intern(sig)
    ps = tuple(k if isinstance(k, str) else SEP.join(k) for k in td.keys(True, True))
    out.extend(td.values(include_nested=True, leaves_only=True))
    return out, _from_paths(ps)


def structure(td: TensorDictBase) -> TreeDef:
    """The :class:`TreeDef` of ``td``."""
    return flatten(td)[1]


def _walk(d: dict, out: list) -> list:
    for v in d.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif _plain(v):
            _walk(v._tensordict, out)
        else:
            out.extend(v.values(include_nested=True, leaves_only=True))
    return out


def leaves(td: TensorDictBase) -> list[torch.Tensor]:
    """The leaf tensors of ``td`` in key order (no copies)."""
    if _plain(td):
        return _walk(td._tensordict, [])
    return list(td.values(include_nested=True, leaves_only=True))


def first_leaf(td: TensorDictBase) -> torch.Tensor:
    """The first leaf tensor of ``td`` in key order, without listing the others (``IndexError``
    if the tree holds no tensor)."""
    if _plain(td):
        for v in td._tensordict.values():
            if isinstance(v, torch.Tensor):
                return v
            try:
                return first_leaf(v)
            except IndexError:
                continue
    else:
        values = leaves(td)
        if values:
            return values[0]
    raise IndexError("first_leaf: the tree holds no tensor")


def paths(td: TensorDictBase) -> list[str]:
    """The dotted key of every leaf of ``td``, in the same order as :func:`leaves`."""
    if _plain(td):
        return list(structure(td).paths)
    return [k if isinstance(k, str) else SEP.join(k) for k in td.keys(True, True)]


def unflatten(like: TensorDictBase, values: Sequence[torch.Tensor]) -> TensorDict:
    """A new TensorDict with the keys of ``like`` and the tensors ``values`` (same order)."""
    return structure(like).unflatten(values)


def from_flat(flat: dict[str, torch.Tensor]) -> TensorDict:
    """Nest a ``{"a.b.c": tensor}`` mapping into a TensorDict (``td["a", "b", "c"]``)."""
    if not flat:
        return TensorDict({}, batch_size=[])
    return TensorDict(flat, batch_size=[]).unflatten_keys(SEP)


def to_flat(td: TensorDictBase) -> dict[str, torch.Tensor]:
    """``{"a.b.c": tensor}`` for every leaf of ``td``, in key order."""
    values, tdef = flatten(td)
    return dict(zip(tdef.paths, values))


def new_tensorclass(cls: type[T], fields: dict[str, TensorDictBase | torch.Tensor]) -> T:
    """``cls(**fields, batch_size=[])`` for a tensorclass whose fields are all tensors or plain
    TensorDicts with an empty batch size, without the constructor's checks in eager mode (about
    five times cheaper; a step builds one state per call). Uses tensordict's private
    ``_new_unsafe``/``_from_tensordict``; the public replacement is the constructor itself."""
    if compiling():
        return cls(**fields, batch_size=[])
    td = TensorDict._new_unsafe(fields, batch_size=_EMPTY_SIZE, nested=False)
    return cls._from_tensordict(td)
