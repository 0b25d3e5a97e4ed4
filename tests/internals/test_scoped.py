"""ftrain.internals.scoped: a Scoped value is the innermost ``using`` block's on the same thread,
the default elsewhere, and leaving a block restores what it found, also on error."""

from __future__ import annotations

import threading

import pytest

from ftrain.internals.scoped import Scoped


def test_blocks_nest_and_leaving_one_restores_the_value_it_found():
    v = Scoped("v", 0)
    assert v.get() == 0
    with v.using(1) as got:
        assert got == 1 and v.get() == 1
        with v.using(2):
            assert v.get() == 2
        assert v.get() == 1
        with v.using(3):  # the same Scoped, again
            assert v.get() == 3
        assert v.get() == 1
    assert v.get() == 0
    assert repr(v) == "Scoped('v', 0)"


def test_the_value_is_restored_on_error():
    v = Scoped("v", "default")
    with pytest.raises(KeyError):
        with v.using("outer"):
            with pytest.raises(ValueError):
                with v.using("inner"):
                    raise ValueError
            assert v.get() == "outer"
            raise KeyError
    assert v.get() == "default"


def test_each_thread_sees_its_own_value():
    v = Scoped("v", "default")
    seen = {}
    inside = threading.Barrier(2)

    def run(name):
        seen[name, "before"] = v.get()
        with v.using(name):
            inside.wait()  # both threads inside their blocks at once
            seen[name, "inside"] = v.get()
            inside.wait()
        seen[name, "after"] = v.get()

    with v.using("main"):
        threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert v.get() == "main"
    for n in ("a", "b"):
        assert seen[n, "before"] == seen[n, "after"] == "default"  # not main's value
        assert seen[n, "inside"] == n


def test_a_compiled_function_reading_it_does_not_recompile_after_its_first_block():
    """Leaving the first block on a thread must not change what dynamo guarded on (whether the
    thread's value exists), or the second call of a compiled step recompiles."""
    import torch

    from ftrain.internals import dynamo

    v = Scoped("v", None)

    @torch.compile(backend="eager")
    def f(x):
        with v.using(x * 2):
            return v.get() + 1

    assert float(f(torch.tensor(1.0))) == 3.0
    with dynamo.error_on_recompile():
        assert float(f(torch.tensor(2.0))) == 5.0
    assert v.get() is None
