"""ftrain.tree: flat views of TensorDict pytrees, in the order of ``td.keys(True, True)``, checked
against tensordict's own public API."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import ftrain as ft
from ftrain import tree


def nested(seed=0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "b": torch.randn(2, generator=g),
            "a": {"y": torch.randn(3, generator=g), "x": {"deep": torch.randn(1, generator=g)}},
            "empty": TensorDict({}, []),
            "c": torch.randn(2, 2, generator=g),
        },
        [],
    )


def public_leaves(td):
    return list(td.values(include_nested=True, leaves_only=True))


def public_paths(td):
    return [".".join(k) if isinstance(k, tuple) else k for k in td.keys(True, True)]


def test_leaves_and_paths_follow_the_key_order_of_tensordict():
    td = nested()
    assert [id(t) for t in tree.leaves(td)] == [id(t) for t in public_leaves(td)]  # no copies
    assert tree.paths(td) == public_paths(td) == ["b", "a.y", "a.x.deep", "c"]
    assert tree.first_leaf(td) is td["b"]
    values, tdef = tree.flatten(td)
    assert [id(t) for t in values] == [id(t) for t in public_leaves(td)]
    assert tdef.paths == tuple(public_paths(td)) and tdef.n == 4
    assert tree.to_flat(td) == dict(zip(public_paths(td), public_leaves(td)))


def test_unflatten_rebuilds_an_equal_tree_holding_the_given_tensors():
    td = nested()
    values, tdef = tree.flatten(td)
    doubled = [2 * v for v in values]
    new = tdef.unflatten(doubled)
    assert public_paths(new) == public_paths(td) and "empty" in new.keys()
    assert [id(t) for t in public_leaves(new)] == [id(t) for t in doubled]
    assert [id(t) for t in public_leaves(tree.unflatten(td, doubled))] == [id(t) for t in doubled]
    with pytest.raises(ValueError, match=r"unflatten: 3 tensors for a tree of 4 leaves"):
        tdef.unflatten(doubled[:3])


def test_structures_are_equal_exactly_when_the_keys_are():
    td = nested()
    assert tree.structure(td) == tree.structure(nested(seed=1))  # other values, same keys
    assert tree.structure(td) is tree.structure(nested(seed=1))  # one shared object, eagerly
    other = td.clone()
    other["a", "z"] = torch.zeros(1)
    assert tree.structure(other) != tree.structure(td)
    reordered = TensorDict({k: td[k] for k in ("c", "b", "a", "empty")}, [])
    assert tree.structure(reordered) != tree.structure(td)  # the same keys in another order


def test_span_child_and_index_locate_sub_trees_and_leaves():
    tdef = tree.structure(nested())
    assert tdef.span("a") == (1, 3) and tdef.span("c") == (3, 4) and tdef.span("empty") == (3, 3)
    assert tdef.child("a").paths == ("y", "x.deep")
    assert tdef.index("a.x.deep") == 2
    with pytest.raises(KeyError, match=r"no key 'z'; its keys are \['b', 'a', 'empty', 'c'\]"):
        tdef.span("z")
    with pytest.raises(KeyError, match=r"'b' is a tensor, not a sub-tree"):
        tdef.child("b")


def test_rebuild_reuses_every_sub_tree_whose_tensors_did_not_change():
    td = nested()
    values, tdef = tree.flatten(td)
    assert tdef.rebuild(values, td) is td  # nothing changed: the tree itself
    changed = list(values)
    changed[0] = values[0] + 1  # "b"
    new = tdef.rebuild(changed, td)
    assert new is not td and new["b"] is changed[0]
    assert new["a"] is td["a"]  # untouched sub-tree: the same container
    changed[2] = values[2] + 1  # "a.x.deep"
    new = tdef.rebuild(changed, td)
    assert new["a"] is not td["a"] and new["a", "x", "deep"] is changed[2]
    assert new["a", "y"] is td["a", "y"]
    assert td["a", "x", "deep"] is values[2]  # the old tree is left as it was


def test_derived_is_computed_once_per_structure():
    calls = []

    def count(tdef):
        calls.append(1)
        return len(tdef.paths)

    def other(tdef):
        return -1

    assert tree.structure(nested()).derived(count) == 4
    assert tree.structure(nested(seed=2)).derived(count) == 4  # same structure: remembered
    assert len(calls) == 1
    assert tree.structure(nested()).derived(other) == -1  # remembered per function


def test_trees_that_are_not_plain_tensordicts_go_through_the_public_api():
    batched = TensorDict({"x": torch.zeros(3, 2), "y": {"z": torch.ones(3)}}, [3])
    td = TensorDict({"p": torch.zeros(1)}, [])
    td["batched"] = batched
    assert tree.paths(td) == public_paths(td) == ["p", "batched.x", "batched.y.z"]
    values, tdef = tree.flatten(td)
    new = tdef.unflatten([v + 1 for v in values])
    assert public_paths(new) == public_paths(td)
    assert torch.equal(new["batched", "y", "z"], torch.full((3,), 2.0))
    assert tree.paths(batched) == ["x", "y.z"]
    assert tree.first_leaf(batched) is batched["x"]


def test_flat_dicts_round_trip_and_an_empty_tree_has_no_first_leaf():
    flat = {"a.b": torch.zeros(1), "a.c": torch.ones(2), "d": torch.zeros(())}
    td = tree.from_flat(flat)
    assert td["a", "c"] is flat["a.c"]
    assert tree.to_flat(td) == flat
    assert tree.to_flat(tree.from_flat({})) == {}
    with pytest.raises(IndexError, match="the tree holds no tensor"):
        tree.first_leaf(TensorDict({"e": TensorDict({}, [])}, []))


def test_new_tensorclass_equals_the_constructor():
    params = tree.from_flat({"w": torch.ones(2)})
    fields = {
        "params": params,
        "opt_state": TensorDict({}, []),
        "step": torch.zeros((), dtype=torch.int64),
        "rng": torch.tensor(3),
        "extra": TensorDict({}, []),
    }
    fast = tree.new_tensorclass(ft.TrainState, fields)
    slow = ft.TrainState(**fields, batch_size=[])
    assert type(fast) is ft.TrainState and fast.params["w"] is params["w"]
    assert public_paths(fast) == public_paths(slow)
    assert int(fast.rng) == 3 and fast.batch_size == slow.batch_size
