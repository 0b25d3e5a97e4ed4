"""ftrain.foreach_loop: torch._foreach_* kernels run per tensor give the kernels' own results,
and under vmap they batch where the kernels have no batching rule."""

import torch

from ftrain.foreach_loop import looped_foreach


def _lists(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 2, generator=g), torch.randn(5, generator=g)]


def test_results_equal_the_multi_tensor_kernels():
    xs, ys = _lists(0), _lists(1)
    s = torch.tensor(1.5)
    cases = [
        lambda f: f._foreach_add(xs, ys, alpha=0.5),
        lambda f: f._foreach_div(xs, s),
        lambda f: f._foreach_mul(xs, [2.0, 3.0]),
        lambda f: f._foreach_lerp(xs, ys, 0.25),
        lambda f: f._foreach_norm(xs),
        lambda f: f._foreach_norm(xs, ord=float("inf")),
        lambda f: f._foreach_sqrt([x.abs() for x in xs]),
        lambda f: f._foreach_sub(xs, ys),
    ]
    for case in cases:
        want = case(torch)
        with looped_foreach():
            got = case(torch)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_in_place_kernels_write_their_first_list_and_return_none():
    for op, args in (
        ("_foreach_addcmul_", (_lists(1), _lists(2), 0.1)),
        ("_foreach_add_", (_lists(1),)),
        ("_foreach_mul_", (torch.tensor(2.0),)),
        ("_foreach_copy_", (_lists(3),)),
        ("_foreach_sign_", ()),
        ("_foreach_lerp_", (_lists(4), 0.5)),
    ):
        want, got = _lists(), _lists()
        getattr(torch, op)(want, *args)
        with looped_foreach():
            assert getattr(torch, op)(got, *args) is None
        for a, b in zip(got, want):
            assert torch.equal(a, b), op


def test_a_kernel_without_a_batching_rule_runs_under_vmap():
    xs = [torch.randn(4, 3), torch.randn(4, 2)]
    d = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def f(a, b, d):
        with looped_foreach():
            return torch._foreach_div([a, b], d)

    out = torch.func.vmap(f)(*xs, d)
    assert torch.equal(out[0], xs[0] / d[:, None]) and torch.equal(out[1], xs[1] / d[:, None])
