"""ft.dp_sgd: without noise, the update of Opacus's clipped and averaged gradient; the noise has the
standard deviation of the formula, is reproducible, and is added once per optimizer step (under
accumulate) and once in total (under shard on 2 processes); refusals at build time."""

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ftrain as ft
from ftrain import tree
from ftrain.step import AutogradEngine, Transform

from _tiny import UNEVEN, lm_batch, lm_loss, tiny_gpt


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 4))


class _Tokens(nn.Module):
    """A per-token classifier without tied weights (Opacus's per-sample hooks need untied)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb, self.norm, self.head = nn.Embedding(16, 8), nn.LayerNorm(8), nn.Linear(8, 16)

    def forward(self, x):  # (B, T) -> (B, T, 16)
        return self.head(torch.tanh(self.norm(self.emb(x))))


def _opacus_update(model, loss_of, batch, clip, n):
    """Params after one SGD(lr=1) step of Opacus's DPOptimizer without noise."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    gsm = GradSampleModule(copy.deepcopy(model))  # loss_reduction="mean"
    opt = DPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=1.0),
        noise_multiplier=0.0,
        max_grad_norm=clip,
        expected_batch_size=n,
    )
    loss_of(gsm, batch).backward()
    norms = torch.stack([p.grad_sample.reshape(n, -1).norm(dim=1) for p in gsm.parameters()], 1)
    opt.step()
    return {k.removeprefix("_module."): p.detach() for k, p in gsm.named_parameters()}, norms.norm(
        dim=1
    )


def _ft_update(model, loss_of, batch, clip):
    sgd = ft.optim.sgd(1.0)
    state = ft.TrainState.create(ft.params_of(model), sgd)
    step = ft.dp_sgd(ft.train_step(lambda p, b: loss_of(_Applied(model, p), b), sgd), clip, 0.0)
    new, metrics = step(state, batch)
    return tree.to_flat(new.params), metrics


class _Applied:
    """``model`` called through ``ft.apply`` with ``params``: one loss definition for both."""

    def __init__(self, model, params):
        self.model, self.params = model, params

    def __call__(self, x):
        return ft.apply(self.model, self.params, x)


def _classify(model, b):
    return F.cross_entropy(model(b[0]), b[1])


def _tokens(model, b):
    logits = model(b[0])  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[1].reshape(-1))


@pytest.mark.parametrize("case", ["classify", "tokens"])
def test_no_noise_equals_opacus(case):
    """noise_multiplier=0: the params after SGD(lr=1) equal Opacus's (clip factor
    min(1, C / (norm + 1e-6)), sum, divided by the batch size) to 1e-5, with some examples
    clipped and some not."""
    pytest.importorskip("opacus")  # a dev dependency
    g = torch.Generator().manual_seed(4)
    if case == "classify":
        model, loss_of, n = _mlp(), _classify, 12
        x = torch.randn(n, 8, generator=g) * torch.linspace(0.1, 3.0, n)[:, None]
        batch = (x, torch.randint(0, 4, (n,), generator=g))
    else:
        model, loss_of, n = _Tokens(), _tokens, 6
        batch = (
            torch.randint(0, 16, (n, 5), generator=g),
            torch.randint(0, 16, (n, 5), generator=g),
        )
    _, norms = _opacus_update(model, loss_of, batch, 1.0, n)
    clip = norms.median().item()  # about half the examples clipped
    want, _ = _opacus_update(model, loss_of, batch, clip, n)
    got, metrics = _ft_update(model, loss_of, batch, clip)
    assert got.keys() == want.keys()
    before = dict(model.named_parameters())
    for k in got:
        assert not torch.equal(want[k], before[k])
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5)
    assert metrics["count"] == n
    assert metrics["clipped"] == (norms > clip).float().mean()


def _gpt_setup(noise, clip=0.05, seed=1):
    model = tiny_gpt()
    sgd = ft.optim.sgd(1.0)  # the update is minus the gradient
    state = ft.TrainState.create(ft.params_of(model), sgd, seed=seed)
    return ft.dp_sgd(ft.train_step(lm_loss(model), sgd), clip, noise), state


def _delta(a, b):
    return torch.cat(
        [(x - y).flatten() for x, y in zip(tree.leaves(a.params), tree.leaves(b.params))]
    )


def test_noise_std_matches_formula():
    """Over 8 steps of ~28k params each, the noise (noisy update minus the noise-free one from the
    same state) has mean ~0 and std noise_multiplier * clip / count within 5%; it differs from
    step to step and is the same for the same state and batch."""
    batch = lm_batch(6, seed=7, lengths=UNEVEN)
    noisy, state = _gpt_setup(noise=1.3)
    clean, _ = _gpt_setup(noise=0.0)
    noises = []
    for _ in range(8):
        new, metrics = noisy(state, batch)
        again, _ = noisy(state, batch)
        assert torch.equal(_delta(new, again), torch.zeros_like(_delta(new, again)))
        ref, _ = clean(state, batch)
        noises.append(_delta(ref, new))
        state = new
    want = 1.3 * 0.05 / 6
    torch.testing.assert_close(metrics["noise_std"], torch.tensor(want))
    z = torch.stack(noises)
    assert abs(z.std().item() / want - 1) < 0.05, z.std().item() / want
    assert abs(z.mean().item()) < 0.01 * want  # 5 standard errors of the mean
    corr = torch.corrcoef(z[:2])[0, 1]  # two steps' noise: independent
    assert abs(corr) < 0.05


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_accumulate_equals_whole_batch(noise):
    """accumulate(4): per-example clipping does not care how the batch is split, and the noise is
    added once per optimizer step, with the same numbers as the whole batch's step."""
    step, state = _gpt_setup(noise)
    batch = lm_batch(8, seed=3, lengths=UNEVEN)
    whole, m1 = step(state, batch)
    split, m4 = ft.accumulate(step, 4)(state, batch)
    for a, b in zip(tree.leaves(whole.params), tree.leaves(split.params)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert m1["count"] == m4["count"] == 8
    torch.testing.assert_close(m1["loss"], m4["loss"])


def test_a_plain_scalar_loss_is_not_warned_about_under_accumulate():
    """Under dp_sgd every example counts once by design, so a plain scalar loss (a mean over its
    one row) is what the step means: no ScalarLossWarning, where the plain step would warn."""
    model = tiny_gpt()

    def scalar_loss(params, batch):
        logits = ft.apply(model, params, batch["input"])
        return F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten())

    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt, seed=0)
    batch = lm_batch(4, seed=1)
    plain = ft.accumulate(ft.train_step(scalar_loss, opt), 2)
    with pytest.warns(ft.losses.ScalarLossWarning):
        plain(state, batch)
    private = ft.accumulate(ft.dp_sgd(ft.train_step(scalar_loss, opt), 1.0, 0.0), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ft.losses.ScalarLossWarning)
        private(state, batch)


def test_bad_arguments_and_orders_are_refused_when_built():
    step = _gpt_setup(0.0)[0]
    plain = ft.train_step(lm_loss(tiny_gpt()), ft.optim.sgd(0.1))
    for clip in (0, -1.0, float("nan"), "1", True):
        with pytest.raises(ValueError, match=r"l2_norm_clip=.*must be a finite number > 0"):
            ft.dp_sgd(plain, clip, 1.0)
    for noise in (-0.1, float("inf"), None):
        with pytest.raises(ValueError, match=r"noise_multiplier=.*must be a finite number >= 0"):
            ft.dp_sgd(plain, 1.0, noise)
    for build in (lambda: ft.checkpoint(step), lambda: ft.dp_sgd(ft.checkpoint(plain), 1.0, 1.0)):
        with pytest.raises(ValueError, match="saved-tensor hooks.*Leave out ft.checkpoint"):
            build()
    with pytest.raises(ValueError, match="applied twice"):
        ft.dp_sgd(step, 1.0, 1.0)

    @dataclasses.dataclass(frozen=True, eq=False)
    class MyEngine(Transform):
        def engine(self, engine):
            return AutogradEngine()

    # either order: an engine set after dp_sgd's could drop the clipping and keep the noise
    for build in (lambda: ft.dp_sgd(MyEngine()(plain), 1.0, 1.0), lambda: MyEngine()(step)):
        with pytest.raises(ValueError, match=r"ft\.dp_sgd replaces the gradient .*ft\.my_engine"):
            build()
    for build in (lambda: ft.vmap(step), lambda: ft.dp_sgd(ft.vmap(plain), 1.0, 1.0)):
        with pytest.raises(ValueError, match=r"ft\.(vmap|dp_sgd) replaces the gradient engine"):
            build()


def test_on_two_ranks_noise_added_once(two_ranks):
    """shard("ddp"/"zero2") on 2 processes, each given half the batch, with noise: the same params
    as one process given the whole batch (noise added once in total, after the reduction)."""
    from _two_ranks import DP_CLIP, DP_NOISE, ROWS, batches, dp_model

    model = dp_model()
    sgd = ft.optim.sgd(1.0)
    step = ft.dp_sgd(ft.train_step(lm_loss(model), sgd), DP_CLIP, DP_NOISE)
    state = ft.TrainState.create(ft.params_of(model), sgd)
    for b in batches():
        state, metrics = step(state, b)
    want = tree.to_flat(state.params)
    for strategy in ("ddp", "zero2"):
        for out in two_ranks:
            got = out["dp_sgd", strategy]
            for k in want:
                torch.testing.assert_close(got["params"][k], want[k], atol=1e-6, rtol=1e-5)
            assert got["count"] == ROWS
            torch.testing.assert_close(got["noise_std"], metrics["noise_std"])
    assert "saved-tensor hooks" in two_ranks[0]["errors"]["dp_sgd with fsdp"]


def test_fp16_loss_scale_is_divided_out_before_clipping():
    """autocast(fp16): the first steps may overflow (one example's gradient is larger than a
    batch mean) and are skipped while the scale backs off; the first applied update is the fp32
    one to fp16's precision (a scale left in would change how many examples are clipped)."""
    model, sgd = tiny_gpt(), ft.optim.sgd(1.0)
    batch = lm_batch(4, lengths=UNEVEN)
    state = ft.TrainState.create(ft.params_of(model), sgd)
    fp32 = ft.dp_sgd(ft.train_step(lm_loss(model), sgd), 0.05, 0.0)
    fp16 = ft.dp_sgd(ft.autocast(ft.train_step(lm_loss(model), sgd), torch.float16), 0.05, 0.0)
    want, m32 = fp32(state, batch)
    st = fp16.init_extra(state)
    for _ in range(6):
        new, m16 = fp16(st, batch)
        if not m16["skipped"]:
            break
        assert torch.equal(_delta(new, st), torch.zeros_like(_delta(new, st)))
        st = new
    assert not m16["skipped"]
    rel = _delta(new, want).norm() / _delta(state, want).norm()
    assert rel < 1e-2, rel
    assert m16["clipped"] == m32["clipped"]
