"""Tests for ftrain.models: the GPT, its mixture-of-experts feed-forward, sampling, FLOP counts."""

import math

import pytest
import torch
import torch.nn.functional as F

from ftrain.models import (
    GPT,
    MLP,
    GPTConfig,
    MoE,
    flops_per_token,
    generate,
    matmul_params_per_token,
    num_params,
    tiny_gpt2,
)

SMALL = dict(vocab_size=37, seq_len=16, d_model=32, n_layer=2, n_head=4)
MOE = dict(SMALL, n_experts=4, top_k=2)


def make(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**SMALL, **overrides}))


def tokens(B=3, T=16, vocab=37, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# --- shapes, state, purity -----------------------------------------------------------------------


@pytest.mark.parametrize("kw", [SMALL, MOE], ids=["dense", "moe"])
def test_logits_shape_and_aux(kw):
    model = GPT(GPTConfig(**kw))
    for T in (1, 7, 16):
        assert model(tokens(T=T)).shape == (3, T, 37)
    logits, aux = model(tokens(), return_aux=True)
    assert logits.shape == (3, 16, 37)
    if kw is SMALL:
        assert aux == {}
    else:
        assert set(aux) == {"moe_aux_loss"} and aux["moe_aux_loss"].dim() == 0
        assert aux["moe_aux_loss"].requires_grad


def test_sequence_longer_than_seq_len_is_refused():
    with pytest.raises(ValueError, match="seq_len=16"):
        make()(tokens(T=17))


def test_state_is_parameters_only():
    for kw in (dict(), dict(tie_weights=False), dict(n_experts=2, bias=False)):
        model = make(**kw)
        assert list(model.buffers()) == []
        params = dict(model.named_parameters())
        assert list(model.state_dict()) == list(params)  # same keys, nothing stored twice
        make(seed=1, **kw).load_state_dict(params)  # strict: a params file loads into a module


@pytest.mark.parametrize("kw", [SMALL, MOE], ids=["dense", "moe"])
def test_functional_call_is_pure(kw):
    """Called through functional_call, the output depends on the given params only, and neither
    the module's parameters nor its attributes change (nothing is stored on self)."""
    torch.manual_seed(0)
    template, other = GPT(GPTConfig(**kw)), GPT(GPTConfig(**kw))
    before = {n: p.clone() for n, p in template.named_parameters()}
    attrs = [sorted(vars(m)) for m in template.modules()]
    params = dict(other.named_parameters())
    got, got_aux = torch.func.functional_call(template, params, (tokens(),), {"return_aux": True})
    want, want_aux = other(tokens(), return_aux=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_aux, want_aux, rtol=0, atol=0)
    assert not torch.equal(got, template(tokens()))
    for n, p in template.named_parameters():
        assert torch.equal(p, before[n]), n
    assert [sorted(vars(m)) for m in template.modules()] == attrs


@pytest.mark.parametrize("kw", [SMALL, MOE], ids=["dense", "moe"])
def test_every_parameter_gets_a_gradient(kw):
    """train_step uses torch.autograd.grad, which raises on a parameter the loss does not use."""
    model = GPT(GPTConfig(**kw))
    idx = tokens(B=8)
    logits, aux = model(idx, return_aux=True)
    loss = F.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten()) + sum(aux.values())
    names, params = zip(*model.named_parameters(), strict=True)
    grads = torch.autograd.grad(loss, params)
    for name, g in zip(names, grads, strict=True):
        assert g.abs().sum() > 0, name


# --- causality, tying, dropout, init -------------------------------------------------------------


@pytest.mark.parametrize("kw", [SMALL, MOE], ids=["dense", "moe"])
def test_causal(kw):
    model = GPT(GPTConfig(**kw))
    idx = tokens()
    changed = idx.clone()
    t = 9
    changed[:, t] = (changed[:, t] + 1) % 37
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().amax(dim=-1).min() > 1e-4  # every later position sees it


def test_weight_tying_uses_the_embedding_as_lm_head():
    idx = tokens(vocab=30)  # tokens 30..36 never appear in the input
    for tie in (True, False):
        model = make(tie_weights=tie)
        before = model(idx)
        with torch.no_grad():
            model.wte.weight[33] += 1.0  # an embedding row only the lm head could read
        moved = (model(idx) - before).abs()
        if tie:
            assert "lm_head.weight" not in dict(model.named_parameters())
            assert moved[..., 33].min() > 0 and moved[..., :33].max() == 0
            (grad,) = torch.autograd.grad(model(idx)[..., 33].sum(), model.wte.weight)
            assert grad[33].abs().sum() > 0  # the head's gradient lands in the embedding
        else:
            assert model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()
            assert moved.max() == 0
    d, V = SMALL["d_model"], SMALL["vocab_size"]
    assert num_params(make(tie_weights=False)) - num_params(make(tie_weights=True)) == V * d


def test_dropout_zero_is_deterministic_in_training_mode():
    model = make(dropout=0.0).train()
    idx = tokens()
    assert torch.equal(model(idx), model(idx))


def test_dropout_acts_in_training_mode_only():
    model = make(dropout=0.3, n_experts=2)
    plain = make(dropout=0.0, n_experts=2)
    plain.load_state_dict(model.state_dict())
    idx = tokens()
    model.train()
    assert not torch.allclose(model(idx), model(idx))
    model.eval()
    torch.testing.assert_close(model(idx), plain(idx), rtol=0, atol=0)
    torch.manual_seed(5)
    a = model.train()(idx)
    torch.manual_seed(5)
    torch.testing.assert_close(model(idx), a, rtol=0, atol=0)  # dropout follows the torch seed


@pytest.mark.parametrize("n_experts", [0, 2])
def test_init_is_gpt2_style(n_experts):
    model = make(d_model=128, n_layer=8, n_head=4, n_experts=n_experts)
    resid = 0.02 / math.sqrt(2 * 8)
    for name, p in model.named_parameters():
        if name.endswith(("attn.proj.weight", "mlp.proj.weight", "mlp.w2")):
            assert p.std().item() == pytest.approx(resid, rel=0.1), name
        elif name.endswith(("bias", "b1", "b2")):
            assert p.abs().max() == 0, name
        elif "ln" in name:
            assert torch.all(p == 1), name
        else:  # embeddings, qkv, mlp.fc, experts' w1, router
            assert p.std().item() == pytest.approx(0.02, rel=0.1), name


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


# --- sampling ------------------------------------------------------------------------------------


def test_generate_length_keeps_prompt_and_crops_context():
    model = make().eval()
    prompt = tokens(B=2, T=5)
    out = generate(model, prompt, 20, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 25) and out.dtype == torch.long  # 25 > seq_len: the context is cropped
    assert torch.equal(out[:, :5], prompt)
    assert out.min() >= 0 and out.max() < 37
    again = generate(model, prompt, 20, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_generate_respects_top_k():
    model = make().eval()
    prompt = tokens(B=4, T=2)
    greedy = generate(model, prompt, 10, temperature=0.0)
    assert torch.equal(generate(model, prompt, 10, top_k=1), greedy)
    out = generate(model, prompt, 12, temperature=2.0, top_k=3, generator=torch.Generator())
    with torch.no_grad():
        logits = model(out[:, :-1])  # logits[:, t] predicted out[:, t + 1]
    top3 = logits[:, 1:].topk(3, dim=-1).indices  # the steps that sampled
    assert (top3 == out[:, 2:, None]).any(-1).all()
    wide = generate(model, prompt, 12, temperature=2.0, generator=torch.Generator())
    with torch.no_grad():
        top3 = model(wide[:, :-1])[:, 1:].topk(3, dim=-1).indices
    assert not (top3 == wide[:, 2:, None]).any(-1).all()  # without top_k, others do get sampled


def test_generate_warns_in_training_mode_and_checks_arguments():
    model = make().train()
    with pytest.warns(UserWarning, match="eval"):
        generate(model, tokens(T=2), 1)
    model.eval()
    with pytest.raises(ValueError, match="top_k"):
        generate(model, tokens(T=2), 1, top_k=0)
    with pytest.raises(ValueError, match="seq_len"):
        generate(torch.nn.Identity(), tokens(T=2), 1)


# --- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(d_model=130, n_head=4), "d_model=130 must be divisible by n_head=4"),
        (dict(n_experts=2, top_k=3), "top_k=3 must be <= n_experts=2"),
        (dict(top_k=0), "top_k=0"),
        (dict(n_experts=-1), "n_experts=-1"),
        (dict(dropout=1.0), "dropout=1.0"),
        (dict(dropout=-0.1), "dropout=-0.1"),
        (dict(n_layer=0), "n_layer=0"),
        (dict(vocab_size=0), "vocab_size=0"),
        (dict(seq_len=2.5), "seq_len=2.5"),
        (dict(n_head=True), "n_head=True"),
        (dict(d_ff=0), "d_ff=0"),
        (dict(aux_loss_weight=-1.0), "aux_loss_weight=-1.0"),
        (dict(norm_eps=0.0), "norm_eps=0.0"),
    ],
)
def test_config_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        GPTConfig(**kw)


def test_config_defaults():
    cfg = GPTConfig()
    assert (cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.n_layer, cfg.n_head) == (
        257,
        128,
        128,
        4,
        4,
    )
    assert cfg.ff_dim == 512 and cfg.head_dim == 32 and cfg.n_experts == 0
    assert GPTConfig(d_ff=100).ff_dim == 100
    GPTConfig(top_k=2)  # top_k is ignored by a dense model


# --- counting ------------------------------------------------------------------------------------


def test_num_params_counts_every_parameter_once():
    cfg = GPTConfig(**SMALL)
    d, V, T, L, h = 32, 37, 16, 2, 128
    block = (2 * 2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
    assert num_params(GPT(cfg)) == V * d + T * d + L * block + 2 * d


def test_flops_per_token():
    cfg = GPTConfig(**SMALL)
    d, V, T, L, h = 32, 37, 16, 2, 128
    assert matmul_params_per_token(cfg) == L * (4 * d * d + 2 * d * h) + d * V
    assert flops_per_token(cfg) == 6 * matmul_params_per_token(cfg) + 12 * L * d * T
    assert flops_per_token(cfg, seq_len=8) == flops_per_token(cfg) - 12 * L * d * 8
    moe = GPTConfig(**SMALL, n_experts=8, top_k=2)  # only the experts a token visits count
    assert matmul_params_per_token(moe) == matmul_params_per_token(cfg) + L * (2 * d * h + d * 8)
    assert num_params(GPT(moe)) > num_params(GPT(cfg)) + L * 6 * 2 * d * h


# --- Hugging Face --------------------------------------------------------------------------------


def test_hf_gpt2_builds():
    pytest.importorskip("transformers")
    model = tiny_gpt2(n_positions=16)
    idx = tokens(vocab=257)
    assert model(idx).logits.shape == (3, 16, 257)
    assert num_params(model) < 200_000
    params = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    out = torch.func.functional_call(model, params, (idx,)).logits
    assert torch.equal(out, torch.zeros_like(out))  # usable as a stateless template


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

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=257, seq_len=16, d_model=32, n_layer=1, n_head=2, n_experts=4, top_k=2)
    )

    def loss_fn(params, batch):
        logits, aux = ft.apply(model, params, batch["input"], return_aux=True)
        ce, moe = ft.losses.cross_entropy(logits, batch["target"]), aux["moe_aux_loss"]
        return ft.Loss(ce.total + moe * ce.count, ce.count)

    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt, seed=1)
    eager = ft.train_step(loss_fn, opt)
    batches = [
        {"input": tokens(B=4, vocab=257, seed=s), "target": tokens(B=4, vocab=257, seed=s + 10)}
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
