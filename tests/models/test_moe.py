"""ftrain.models.moe: the mixture-of-experts feed-forward against a per-token loop and the dense
MLP, its routing and balance loss, and the expert_mm custom op under torch.compile."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from ftrain.models import MLP, GPTConfig, MoE

from _tiny import TINY_GPT, tiny_gpt
from _tiny import tokens as tiny_tokens

VOCAB = 37  # odd, shared by no other dimension: a shape mix-up shows
SMALL = dict(TINY_GPT, vocab_size=VOCAB)
make = partial(tiny_gpt, vocab_size=VOCAB)  # make(seed=0, **config_overrides)
tokens = partial(tiny_tokens, vocab=VOCAB)  # tokens(rows=3, length=16, seed=1)


# --- mixture of experts --------------------------------------------------------------------------


def copy_mlp_into_moe(mlp, moe):
    with torch.no_grad():
        moe.w1[0].copy_(mlp.fc.weight.T)
        moe.b1[0].copy_(mlp.fc.bias)
        moe.w2[0].copy_(mlp.proj.weight.T)
        moe.b2[0].copy_(mlp.proj.bias)


def test_moe_with_one_expert_equals_dense_mlp():
    torch.manual_seed(0)
    mlp = MLP(GPTConfig(**SMALL))
    moe = MoE(GPTConfig(**SMALL, n_experts=1, top_k=1))
    copy_mlp_into_moe(mlp, moe)
    x = torch.randn(4, 16, 32)
    y, balance = moe(x)
    torch.testing.assert_close(y, mlp(x), rtol=0, atol=1e-6)
    assert balance.item() == pytest.approx(1.0)  # one expert is trivially balanced

    # the same holds for whole models
    dense = make(seed=1)
    mixed = make(seed=2, n_experts=1, top_k=1)
    mixed.load_state_dict(
        {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}, strict=False
    )
    for dense_block, mixed_block in zip(dense.blocks, mixed.blocks, strict=True):
        copy_mlp_into_moe(dense_block.mlp, mixed_block.mlp)
    logits, aux = mixed(tokens(), return_aux=True)
    torch.testing.assert_close(logits, dense(tokens()), rtol=0, atol=1e-5)
    assert aux["moe_aux_loss"].item() == pytest.approx(0.01)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_matches_a_per_token_loop(top_k):
    torch.manual_seed(0)
    moe = MoE(GPTConfig(**SMALL, n_experts=4, top_k=top_k))
    x = torch.randn(2, 8, 32)
    y, _ = moe(x)
    probs = F.softmax(moe.router(x), dim=-1)  # (B, T, E)
    for b in range(2):
        for t in range(8):
            p, e = probs[b, t].topk(top_k)
            g = p / p.sum() if top_k > 1 else p
            want = sum(g[i] * moe.expert(int(e[i]), x[b, t : t + 1])[0] for i in range(top_k))
            torch.testing.assert_close(y[b, t], want, rtol=1e-5, atol=1e-6)


def test_moe_gates():
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    probs, gates, experts = MoE(GPTConfig(**SMALL, n_experts=4, top_k=2)).route(x)
    torch.testing.assert_close(gates.sum(-1), torch.ones(64))  # renormalized over the chosen 2
    assert (experts[:, 0] != experts[:, 1]).all()
    probs, gates, experts = MoE(GPTConfig(**SMALL, n_experts=4, top_k=1)).route(x)
    torch.testing.assert_close(gates[:, 0], probs.max(-1).values)  # Switch: the raw probability
    assert gates.max() < 1


def test_moe_routes_in_float32_under_autocast():
    model = make(n_experts=4, top_k=2)
    idx = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, aux = model(idx, return_aux=True)
        probs, gates, _ = model.blocks[0].mlp.route(torch.randn(5, 32))
    assert aux["moe_aux_loss"].dtype == probs.dtype == gates.dtype == torch.float32
    torch.testing.assert_close(logits.float(), model(idx), rtol=0.05, atol=0.05)


def test_top1_router_learns_from_the_language_model_loss():
    model = make(n_experts=4, top_k=1)
    idx = tokens()
    loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())  # no aux loss
    (g,) = torch.autograd.grad(loss, model.blocks[0].mlp.router.weight)
    assert g.abs().sum() > 0


def test_balance_loss_is_one_when_uniform_and_n_experts_when_collapsed():
    torch.manual_seed(0)
    moe = MoE(GPTConfig(**SMALL, n_experts=4, top_k=1))
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        moe.router.weight.zero_()  # uniform probabilities
    assert moe(x)[1].item() == pytest.approx(1.0)
    with torch.no_grad():
        moe.router.weight[2] = 1.0  # with x + 10, expert 2 gets every token with probability ~1
    assert moe(x + 10.0)[1].item() == pytest.approx(4.0, rel=1e-3)


def test_aux_loss_balances_routing():
    """Gradient descent on the balance loss alone spreads a collapsed router over the experts."""
    torch.manual_seed(0)
    moe = MoE(GPTConfig(**{**SMALL, "d_model": 16, "n_head": 1}, n_experts=4, top_k=1))
    x = torch.randn(1, 256, 16)
    x[..., 0] = 1.0  # a constant feature: the router's only way to prefer an expert for every token
    with torch.no_grad():
        moe.router.weight.normal_(0.0, 0.3)  # token-dependent preferences...
        moe.router.weight[:, 0] = 0.0
        moe.router.weight[0, 0] = 3.0  # ...skewed: most tokens go to expert 0

    def max_fraction():
        _, _, experts = moe.route(x[0])
        return torch.bincount(experts.flatten(), minlength=4).max().item() / experts.numel()

    before, (_, loss_before) = max_fraction(), moe(x)
    opt = torch.optim.SGD(moe.router.parameters(), lr=1.0)
    for _ in range(50):
        opt.zero_grad()
        moe(x)[1].backward()
        opt.step()
    after, (_, loss_after) = max_fraction(), moe(x)
    assert before > 0.8 and after < 0.35  # 0.25 is perfect balance
    assert loss_after < loss_before - 1.0


# --- MoE under torch.compile ---------------------------------------------------------------------


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_moe_fused_experts_equal_the_eager_loop(autocast):
    """The custom-op path (used under torch.compile) computes the eager loop's outputs and
    gradients, biases included, also when an expert gets no tokens; under autocast with the same
    dtypes (bf16 matmuls, fp32 bias additions, so an fp32 output)."""
    torch.manual_seed(0)
    moe = MoE(GPTConfig(**SMALL, n_experts=4, top_k=2))
    with torch.no_grad():
        for p in (moe.b1, moe.b2):
            p.normal_()
    xs = torch.randn(24, 32, requires_grad=True)
    counts = torch.tensor([7, 0, 12, 5])  # expert 1 idle
    g = torch.randn(24, 32)
    results = []
    for fused in (False, True):
        params = [xs, *moe.parameters()]
        for p in params:
            p.grad = None
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y = moe.experts(xs, counts, fused=fused)
        (y * g).sum().backward()
        results.append([y.detach()] + [p.grad for p in params if p is not moe.router.weight])
    assert results[0][0].dtype == results[1][0].dtype == torch.float32
    tol = 1e-2 if autocast else 1e-5  # bf16 products: same ops, summation order may differ
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert results[1][2][1].abs().max() == 0  # idle expert: zero w1 gradient


def test_moe_step_compiles_without_graph_breaks_or_recompiles():
    """ft.compile of a training step on a tiny MoE GPT: the model's forward is one graph (no
    break in the MoE), and the step does not recompile over 3 steps whose batches route
    differently. aot_eager traces forward and backward (the custom op's fake and backward
    included) without inductor's slow code generation. (The step itself breaks the graph at
    torch.autograd.grad, which is ftrain's and not the model's.)"""
    import ftrain as ft
    from ftrain.testing import assert_no_recompile

    model = tiny_gpt(vocab_size=257, n_layer=1, n_head=2, n_experts=4, top_k=2)

    def loss_fn(params, batch):
        logits, aux = ft.apply(model, params, batch["input"], return_aux=True)
        ce, moe = ft.losses.cross_entropy(logits, batch["target"]), aux["moe_aux_loss"]
        return ft.Loss(ce.total + moe * ce.count, ce.count)

    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt, seed=1)
    eager = ft.train_step(loss_fn, opt)
    batches = [
        {
            "input": tokens(rows=4, vocab=257, seed=s),
            "target": tokens(rows=4, vocab=257, seed=s + 10),
        }
        for s in range(3)
    ]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(batches[0]["input"], return_aux=True)
    assert explained.graph_break_count == 0, explained.break_reasons
    final, history = assert_no_recompile(ft.compile(eager, backend="aot_eager"), state, batches)

    s = state
    for batch, m_compiled in zip(batches, history):
        s, m = eager(s, batch)
        torch.testing.assert_close(m_compiled["loss"], m["loss"], rtol=1e-5, atol=1e-5)
    for a, b in zip(ft.tree.leaves(final.params), ft.tree.leaves(s.params)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
