"""ftrain.models.gpt: the GPT's shapes, purity, causality, weight tying, dropout, init, its config,
and the matmul its linears use (GPTConfig.matmul)."""

import math
import os
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ftrain import data
from ftrain.models import GPT, GPTConfig, choose_matmul, num_params, onednn_linear_available
from ftrain.models.gpt import MATMULS, document_mask

from _hf import packed_and_alone
from _tiny import TINY_GPT, tiny_gpt
from _tiny import tokens as tiny_tokens

VOCAB = 37  # odd, shared by no other dimension: a shape mix-up shows
SMALL = dict(TINY_GPT, vocab_size=VOCAB)
MOE = dict(SMALL, n_experts=4, top_k=2)
make = partial(tiny_gpt, vocab_size=VOCAB)  # make(seed=0, **config_overrides)
tokens = partial(tiny_tokens, vocab=VOCAB)  # tokens(rows=3, length=16, seed=1)


# --- shapes, state, purity -----------------------------------------------------------------------


@pytest.mark.parametrize("kw", [SMALL, MOE], ids=["dense", "moe"])
def test_logits_shape_and_aux(kw):
    model = GPT(GPTConfig(**kw))
    for T in (1, 7, 16):
        assert model(tokens(length=T)).shape == (3, T, VOCAB)
    logits, aux = model(tokens(), return_aux=True)
    assert logits.shape == (3, 16, VOCAB)
    if kw is SMALL:
        assert aux == {}
    else:
        assert set(aux) == {"moe_aux_loss"} and aux["moe_aux_loss"].dim() == 0
        assert aux["moe_aux_loss"].requires_grad


def test_sequence_longer_than_seq_len_is_refused():
    with pytest.raises(ValueError, match="seq_len=16"):
        make()(tokens(length=17))


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
    idx = tokens(rows=8)
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
    changed[:, t] = (changed[:, t] + 1) % VOCAB
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
        (dict(matmul="mkl"), "matmul='mkl' must be one of \\['auto', 'onednn', 'torch'\\]"),
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


# --- which matmul the linears use ----------------------------------------------------------------


@pytest.mark.parametrize("kw", [SMALL, MOE], ids=["dense", "moe"])
def test_matmul_selects_the_class_of_every_linear(kw):
    """'onednn' builds every linear (qkv, proj, fc, the MoE router, an untied lm head) as
    ftrain.models.Linear, 'torch' as a plain nn.Linear, 'auto' as the kernel it resolved to
    (model.matmul); parameters are the same either way."""
    built = {}
    for matmul in ("onednn", "torch", "auto"):
        model = make(**kw, tie_weights=False, matmul=matmul)
        assert model.matmul == choose_matmul(model.config) and model.matmul in MATMULS
        assert model.config.matmul == matmul  # the config as given; the answer on the model
        cls = MATMULS[model.matmul][0]
        linears = {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        # per block: attn.qkv, attn.proj, then mlp.fc, mlp.proj or the MoE router; then lm_head
        per_block = 4 if kw is SMALL else 3
        assert len(linears) == SMALL["n_layer"] * per_block + 1, sorted(linears)
        assert set(linears.values()) == {cls}, linears
        built[matmul] = model
    assert GPTConfig().matmul == "auto"
    assert built["onednn"].matmul == "onednn" and built["torch"].matmul == "torch"
    for (n, a), (m, b) in zip(
        built["onednn"].named_parameters(), built["torch"].named_parameters(), strict=True
    ):
        assert n == m and torch.equal(a, b), n  # same init from the same seed


def test_the_matmul_table_is_read_only():
    with pytest.raises(TypeError):
        MATMULS["mine"] = (nn.Linear, torch.nn.functional.linear)  # type: ignore[index]
    assert set(MATMULS) == {"onednn", "torch"}


def took_onednn(y: torch.Tensor) -> bool:
    return type(y.grad_fn).__name__ == "_OneDNNLinearBackward"


@pytest.mark.parametrize("kw", [{}, dict(n_experts=2, top_k=1)], ids=["dense", "moe"])
def test_onednn_and_torch_matmuls_give_the_same_loss_and_gradients(kw):
    """A GPT wide enough that 'onednn' sends its matmuls to oneDNN (where this machine has it)
    and the same GPT with 'torch' (F.linear): equal loss and gradients to float32 rounding."""
    cfg = dict(vocab_size=64, seq_len=64, d_model=64, n_layer=2, n_head=2, **kw)
    idx = tokens(rows=8, length=64, vocab=64)
    results = []
    for matmul in ("onednn", "torch"):
        model = make(**cfg, matmul=matmul)
        qkv = model.blocks[0].attn.qkv(torch.randn(8, 64, 64, requires_grad=True))
        assert took_onednn(qkv) == (matmul == "onednn" and onednn_linear_available())
        logits, aux = model(idx, return_aux=True)
        loss = F.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten())
        loss = loss + sum(aux.values())
        results.append([loss, *torch.autograd.grad(loss, list(model.parameters()))])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def fake_timing(monkeypatch, tmp_path, onednn: float, torch_: float) -> list:
    """Route faster_linear's cache to ``tmp_path`` and make every timing answer these seconds;
    returns the list of (shapes, rows) it was asked to time."""
    from ftrain.models import onednn as onednn_module

    asked = []

    def time_linears(shapes, rows, **_):
        asked.append((shapes, rows))
        return {"onednn": onednn, "torch": torch_}

    monkeypatch.setenv("FTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(onednn_module, "time_linears", time_linears)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine: timed
    return asked


# large enough to be timed: 16 * 64 rows of d 64 (about 50M multiply-adds a forward in oneDNN)
TIMED = dict(vocab_size=64, seq_len=64, d_model=64, n_layer=2, n_head=2)


@pytest.mark.skipif(not onednn_linear_available(), reason="no oneDNN linear kernel here")
@pytest.mark.parametrize("seconds, want", [((1.0, 2.0), "onednn"), ((0.97, 1.0), "torch"),
                                           ((2.0, 1.0), "torch")])  # fmt: skip
def test_auto_takes_the_kernel_that_timed_faster(monkeypatch, tmp_path, seconds, want):
    """'auto' resolves to what the timing says (oneDNN only when under 0.95 of torch's time: a
    3% lead is noise), on the model's own shapes at 16 * seq_len rows; a second model of the
    same shapes reads the answer from the cache instead of timing again."""
    asked = fake_timing(monkeypatch, tmp_path, *seconds)
    model = make(**TIMED)
    assert model.matmul == want
    assert set(type(m) for m in model.modules() if isinstance(m, nn.Linear)) == {MATMULS[want][0]}
    ((shapes, rows),) = asked
    assert rows == 16 * 64 and sorted(shapes) == sorted(
        [(64, 192, 2), (64, 64, 2), (64, 256, 2), (256, 64, 2), (64, 64, 1)]
    )
    assert make(**TIMED, dropout=0.1).matmul == want and len(asked) == 1  # cached
    assert choose_matmul(GPTConfig(**TIMED), rows=4096) == want and len(asked) == 2  # new rows


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # mkldnn.flags()
def test_auto_falls_back_to_torch_untimed_where_onednn_cannot_run(monkeypatch, tmp_path):
    """Where the oneDNN path would not run (oneDNN switched off, a model built for another
    device or on fake tensors, a model too small for oneDNN's side to matter) 'auto' is 'torch'
    without timing."""
    asked = fake_timing(monkeypatch, tmp_path, 1.0, 2.0)  # oneDNN would win, were it timed
    with torch.backends.mkldnn.flags(enabled=False):
        assert make(**TIMED).matmul == "torch"
    with torch.device("meta"):
        assert make(**TIMED).matmul == "torch"
    with torch._subclasses.FakeTensorMode():  # a model built to be planned, not run
        assert make(**TIMED).matmul == "torch"
    assert tiny_gpt().matmul == "torch"  # d 32: 8M multiply-adds a forward
    assert asked == []
    assert make(**TIMED, matmul="onednn").matmul == "onednn"  # forced: never timed either
    assert asked == []
    if onednn_linear_available():
        assert make(**TIMED).matmul == "onednn" and len(asked) == 1


def test_docstring_examples_run():
    import doctest

    import ftrain.models.gpt

    result = doctest.testmod(ftrain.models.gpt)
    assert result.attempted > 0 and result.failed == 0


def test_packed_rows_give_each_document_its_losses_alone(tmp_path):
    """--pack's invariant: the per-token losses of a packed row equal those of each of its
    documents run alone (a block-diagonal causal mask and positions restarting at 0)."""
    words = ["alpha", "beta", "gamma", "delta", " ", "\n"]
    g = torch.Generator().manual_seed(0)
    texts = [
        (str(i), "".join(words[j] for j in torch.randint(0, 6, (int(n),), generator=g)))
        for i, n in enumerate(torch.randint(1, 8, (30,), generator=g))
    ]
    data.build_token_dataset(texts, tmp_path, progress=False)
    rows = data.TokenDataset(tmp_path, 64, seed=0, pack=True, splits=(1, 0, 0))
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=64, d_model=32, n_layer=2, n_head=2)).eval()
    for i in range(3):
        packed, alone, docs = packed_and_alone(lambda x, pos: model(x, position_ids=pos), rows[i])
        assert docs >= 3
        torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    leaky, alone, _ = packed_and_alone(lambda x, pos: model(x), rows[0])
    assert (leaky - alone).abs().max() > 1e-2  # without the mask, documents see each other


def test_document_mask_is_block_diagonal_causal():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 5, 6, 7, 8]])
    m = document_mask(pos)[:, 0]
    doc = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    for b in range(2):
        for q in range(6):
            for k in range(6):
                assert bool(m[b, q, k]) == (k <= q and doc[b, q] == doc[b, k])
