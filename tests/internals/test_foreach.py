"""ftrain.internals.foreach: each function is its torch._foreach_* kernel; inside looped() it runs
per tensor with the kernel's own results, and then batches under vmap (also compiled) where the
kernel has no batching rule."""

import torch

from ftrain.internals import foreach


def _lists(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 2, generator=g), torch.randn(5, generator=g)]


def _positive(seed):
    return [x.abs() + 0.1 for x in _lists(seed)]


def test_every_function_is_its_kernel_and_its_loop_gives_the_same_results():
    xs, ys = _lists(0), _lists(1)
    s = torch.tensor(1.5)
    cases = [
        ("add", (xs, ys), {"alpha": 0.5}),
        ("div", (xs, s), {}),
        ("mul", (xs, [2.0, 3.0]), {}),
        ("lerp", (xs, ys, 0.25), {}),
        ("norm", (xs,), {}),
        ("norm", (xs,), {"ord": float("inf")}),
        ("sqrt", ([x.abs() for x in xs],), {}),
        ("sub", (xs, ys), {}),
    ]
    for name, args, kwargs in cases:
        want = getattr(torch, "_foreach_" + name)(*args, **kwargs)
        fused = getattr(foreach, name)(*args, **kwargs)
        with foreach.looped():
            got = getattr(foreach, name)(*args, **kwargs)
        assert len(got) == len(want), name
        for a, b, c in zip(got, fused, want):
            assert torch.equal(a, c) and torch.equal(b, c), name


def test_in_place_functions_write_and_return_their_first_list():
    for name, args in (
        ("addcmul_", (_lists(1), _lists(2), 0.1)),
        ("add_", (_lists(1),)),
        ("mul_", (torch.tensor(2.0),)),
        ("div_", (_lists(5),)),
        ("copy_", (_lists(3),)),
        ("sign_", ()),
        ("sqrt_", ()),
        ("reciprocal_", ()),
        ("lerp_", (_lists(4), 0.5)),
    ):
        want, fused, got = _positive(0), _positive(0), _positive(0)
        getattr(torch, "_foreach_" + name)(want, *args)
        assert getattr(foreach, name)(fused, *args) is fused
        with foreach.looped():
            assert getattr(foreach, name)(got, *args) is got
        for a, b, c in zip(got, fused, want):
            assert torch.equal(a, c) and torch.equal(b, c), name


def test_the_loop_ends_with_its_block():
    xs = [torch.ones(2)]
    with foreach.looped():
        pass
    # the fused kernel returns torch's own container type; the loop returns a list
    assert type(foreach.add(xs, xs)) is type(torch._foreach_add(xs, xs))


def _div(a, b, d):
    return foreach.div([a, b], d)


def test_a_kernel_without_a_batching_rule_runs_under_vmap_eager_and_compiled():
    xs = [torch.randn(4, 3), torch.randn(4, 2)]
    d = torch.tensor([1.0, 2.0, 3.0, 4.0])
    for run in (
        torch.func.vmap(_div),
        torch.compile(torch.func.vmap(_div), backend="eager", fullgraph=True),
    ):
        with foreach.looped():
            out = run(*xs, d)
        assert torch.equal(out[0], xs[0] / d[:, None]) and torch.equal(out[1], xs[1] / d[:, None])
