"""ftrain.internals.keyed_dropout: dropout masks as a pure function of a key, batched by vmap."""

import pytest
import torch
import torch.nn.functional as F

from ftrain import rng
from ftrain.internals.keyed_dropout import attention, dropout, keyed_dropout


def test_dropout_mask_is_the_keyed_uniform_stream():
    x = torch.randn(5, 7)
    out = dropout(x, 0.3, torch.tensor(11))
    keep = rng.uniform(torch.tensor(11), x.shape) >= 0.3
    assert torch.equal(out, torch.where(keep, x * (1 / 0.7), torch.zeros_like(x)))


def test_calls_in_a_block_draw_from_fold_in_of_the_key_and_the_call_index():
    x = torch.randn(4, 6)
    key = torch.tensor(3)
    with keyed_dropout(key):
        a = F.dropout(x, 0.5)
        b = torch.nn.Dropout(0.5)(x)
        same = F.dropout(x, 0.5, training=False)
    assert torch.equal(a, dropout(x, 0.5, rng.fold_in(key, 0)))
    assert torch.equal(b, dropout(x, 0.5, rng.fold_in(key, 1)))
    assert same is x


def test_under_vmap_each_key_gives_its_own_masks_independent_of_the_others():
    x = torch.randn(2, 3, 8, 4)  # (B, heads, T, hs)

    def f(key):
        with keyed_dropout(key):
            return F.dropout(x, 0.2), F.scaled_dot_product_attention(
                x, x, x, is_causal=True, dropout_p=0.3
            )

    keys = torch.tensor([5, 9, 13])
    many = torch.func.vmap(f)(keys)
    for i, k in enumerate(keys):
        one = f(k)
        for got, want in zip(many, one):
            assert torch.allclose(got[i], want, atol=1e-6)
    assert not torch.equal(many[0][0], many[0][1])


def test_a_compiled_vmap_applies_the_block_in_its_graph():
    """Dynamo traces the mode entered inside the vmapped function (fullgraph: no fallback to
    eager), so the compiled masks are the keyed ones, not torch's generators'."""
    x = torch.randn(2, 3, 8, 4)  # (B, heads, T, hs)

    def f(key):
        with keyed_dropout(key):
            return F.dropout(x, 0.2), F.scaled_dot_product_attention(
                x, x, x, is_causal=True, dropout_p=0.3
            )

    keys = torch.tensor([5, 9])
    want = torch.func.vmap(f)(keys)
    got = torch.compile(torch.func.vmap(f), backend="eager", fullgraph=True)(keys)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_without_dropout_matches_sdpa(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    mask = torch.randn(6, 6, generator=g) if not causal else None
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    got = attention(q, k, v, mask, 0.0, causal, None, False, torch.tensor(0))
    assert torch.allclose(got, want, atol=1e-5)
    kv = k[:, :2], v[:, :2]  # grouped-query attention: 4 query heads over 2 key/value heads
    want = F.scaled_dot_product_attention(q, *kv, is_causal=causal, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(
        attention(q, *kv, mask, 0.0, causal, None, True, torch.tensor(0)), want, atol=1e-5
    )


def test_dropout_keeps_the_expected_fraction():
    out = dropout(torch.ones(100_000), 0.25, torch.tensor(1))
    assert abs(float((out == 0).float().mean()) - 0.25) < 0.01
    assert torch.allclose(out[out != 0], torch.tensor(1 / 0.75))


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_a_probability_outside_0_1_is_refused_as_torch_refuses_it(p):
    x = torch.ones(4)
    with pytest.raises(ValueError, match="between 0 and 1") as theirs:
        F.dropout(x, p)
    with keyed_dropout(torch.tensor(1)), pytest.raises(ValueError) as ours:
        F.dropout(x, p, training=False)  # checked before training is looked at, as torch does
    assert str(ours.value) == str(theirs.value)
