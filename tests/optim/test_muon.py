"""ftrain.optim.muon against torch.optim.Muon, an SVD, and the same steps done by hand.

Two comparisons with torch:

* *trajectory*: 50 steps from the same params and gradients, the gradients a fixed sequence (the
  gradient of a loss linear in the params), so both sides orthogonalize the same momentum and the
  params differ only by the rounding of the two bfloat16 Newton–Schulz kernels, which depend on
  the processor (the bound is derived in ``bf16_trajectory_bound``). Gradients computed from the params would not do: a 1-ulp
  change of the params flips bfloat16 roundings inside Newton–Schulz, and on the tiny GPT torch's
  Muon started 1 ulp away ends 4e-2 away from itself after 50 steps.
* *step for step* on the tiny GPT: along torch's own run, each ftrain update from torch's params,
  momentum and gradients gives torch's next params.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
import torch.nn.functional as F

import ftrain as ft
from ftrain import optim, tree
from ftrain.optim.muon import newton_schulz_cost
from ftrain.testing import assert_no_recompile, max_rel_error

from _tiny import lm_batch, lm_loss, tiny_gpt

STEPS = 50
SHAPES = {"tall": (48, 16), "wide": (16, 40), "square": (24, 24), "tall_too": (48, 16)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def hidden_names(model) -> list[str]:
    params = ft.params_of(model)
    labels = optim.muon_labels(params)
    return [k for k in tree.paths(params) if labels[tuple(k.split("."))] == "muon"]


# -- Newton–Schulz ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(48, 16), (16, 40), (24, 24)], ids=["tall", "wide", "square"])
def test_newton_schulz_is_torchs_and_near_the_polar_factor(shape):
    """One step of torch's Muon with lr 1 and no momentum moves the params by exactly
    ``-NS(g)`` times the shape factor; NS(g) is near ``U V^T`` of the SVD ``g = U S V^T``."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    p = torch.zeros(shape, requires_grad=True)
    p.grad = g.clone()
    torch.optim.Muon([p], lr=1.0, momentum=0.0, weight_decay=0.0).step()
    factor = max(1.0, shape[0] / shape[1]) ** 0.5
    ns = optim.newton_schulz(g)
    assert ns.dtype == torch.bfloat16 and ns.shape == shape
    assert torch.equal(-ns.float() * factor, p.detach())
    u, _, vt = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vt
    cosine = (ns.float() * polar).sum() / (ns.float().norm() * polar.norm())
    assert cosine > 0.97
    singular = torch.linalg.svdvals(ns.float())
    assert singular.min() > 0.5 and singular.max() < 1.3  # near 1, not at 1 (by design)


def test_a_batch_of_matrices_gives_the_bits_of_one_at_a_time():
    g = torch.randn(3, 40, 16, generator=torch.Generator().manual_seed(1))
    batch = optim.newton_schulz(g)
    assert all(torch.equal(batch[i], optim.newton_schulz(g[i])) for i in range(3))


@pytest.mark.parametrize("shape", [(40, 16), (16, 40), (8, 8)])
def test_newton_schulz_cost_is_the_multiply_adds_of_one_step(shape):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:  # counts 2 flops per multiply-add
        optim.newton_schulz(torch.randn(shape), steps=1)
    assert newton_schulz_cost(torch.Size(shape)) == counter.get_total_flops() // 2


# -- muon against torch.optim.Muon ---------------------------------------------------------------

CASES = [
    dict(weight_decay=0.0),
    dict(weight_decay=0.1),
    dict(weight_decay=0.1, nesterov=False),
    dict(weight_decay=0.0, momentum=0.9, adjust_lr_fn="match_rms_adamw"),
    dict(weight_decay=0.01, ns_steps=3, eps=1e-3, ns_coefficients=(2.0, -1.5, 0.5)),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_muon_matches_torch_over_50_steps(kw):
    g = torch.Generator().manual_seed(0)
    init = {k: torch.randn(s, generator=g) * 0.1 for k, s in SHAPES.items()}
    grads = [{k: torch.randn(s, generator=g) for k, s in SHAPES.items()} for _ in range(STEPS)]
    want = [init[k].clone() for k in SHAPES]
    reference = torch.optim.Muon(want, lr=0.02, **kw)
    opt = optim.muon(0.02, **kw)
    params = tree.from_flat({k: v.clone() for k, v in init.items()})
    state = opt.init(params)
    for step_grads in grads:
        for p, k in zip(want, SHAPES):
            p.grad = step_grads[k].clone()
        reference.step()
        updates, state = opt.update(tree.from_flat(step_grads), state, params)
        params = optim.apply_updates(params, updates)
    for p, k in zip(want, SHAPES):
        assert rel(params[k], p) <= bf16_trajectory_bound(p, SHAPES[k], **kw), k
        assert rel(init[k], p) > 0.1  # the run moved the params: the agreement is not trivial


def bf16_trajectory_bound(p_end, shape, adjust_lr_fn=None, **_) -> float:
    """What the 50-step comparison with torch can promise on any processor, relative to
    ``||p_end||``: the rounding of two bfloat16 Newton–Schulz kernels, summed over the steps.

    The gradients are fixed, so both runs orthogonalize the same momentum at every step and the
    params differ only by what the two Newton–Schulz computations return:
    ``p_T - p'_T = -sum_t lr_eff (1 - lr wd)^(T-t) (O_t - O'_t)``, no feedback through the params.
    Both run in bfloat16, ftrain batching same-shape matrices (bmm) where torch runs mm, and which
    bf16 kernel each op takes (oneDNN, AMX, the native gemm) depends on the processor. Their fp32
    accumulation orders differ, so some elements round to neighbouring bf16 values, and the five
    iterations carry such flips on: on these shapes, two correctly rounding kernels (fp32
    accumulation rounded once, in two summation orders; oneDNN against the native gemm) give
    ``||O - O'|| / ||O||`` of RMS 0.6e-3 to 1.1e-3 (800 draws per shape, peaks 1.2e-2), under one
    bf16 ulp, 2^-8 = 3.9e-3, which this bound takes. Roundings of different steps are
    independent, so they add as a random walk: ``||p_T - p'_T|| <= lr_eff sqrt(T) 2^-8 ||O||``,
    with ``||O|| <= 1.3 sqrt(min(m, n))`` (singular values under 1.3, as tested above) and weight
    decay's factors at most 1: about 1e-3 for these cases. Measured: the same kernels on both
    sides agree to 1e-6 (AMD EPYC); an Intel Xeon's tall matrix was 8.4e-5 off; torch's side
    run through the other kernels above gave at most 4.4e-4, each case under its bound."""
    rows, cols = shape
    if adjust_lr_fn == "match_rms_adamw":  # torch.optim.Muon's two rules for the step size
        lr_eff = 0.02 * 0.2 * max(rows, cols) ** 0.5
    else:
        lr_eff = 0.02 * max(1.0, rows / cols) ** 0.5
    o_norm = 1.3 * min(rows, cols) ** 0.5
    return lr_eff * STEPS**0.5 * 2.0**-8 * o_norm / p_end.norm().item()


def test_muon_matches_torch_step_for_step_on_a_gpt():
    """The hidden matrices of the tiny GPT, real gradients, 50 steps of torch's run; each ftrain
    update starts from torch's params and momentum (1e-6: float32 rounding, no amplification)."""
    model = copy.deepcopy(tiny_gpt())
    names = hidden_names(model)
    named = dict(model.named_parameters())
    reference = torch.optim.Muon([named[k] for k in names], lr=0.02, weight_decay=0.1)
    opt = optim.muon(0.02, weight_decay=0.1)
    state = opt.init(tree.from_flat({k: named[k].detach() for k in names}))
    for i in range(STEPS):
        batch = lm_batch(4, seed=i)
        reference.zero_grad()
        logits = model(batch["input"])
        F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten()).backward()
        params = tree.from_flat({k: named[k].detach().clone() for k in names})
        grads = tree.from_flat({k: named[k].grad.clone() for k in names})
        for k in names:
            momentum = reference.state.get(named[k], {}).get("momentum_buffer")
            key = ("0", "ema", *k.split("."))
            state[key] = torch.zeros_like(named[k]) if momentum is None else momentum.clone()
        updates, state = opt.update(grads, state, params)
        got = optim.apply_updates(params, updates)
        reference.step()
        for k in names:
            assert max_rel_error(got[tuple(k.split("."))], named[k].detach()) <= 1e-6, (i, k)


@pytest.mark.parametrize("nesterov", [False, True])
def test_ema_momentum_by_hand(nesterov):
    """``m = 0.9 m + 0.1 g``; the update is ``m``, or ``0.1 g + 0.9 m`` with nesterov: ``trace``
    times 0.1 (the same direction, another scale)."""
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(5, 3, generator=g) for _ in range(4)]
    ema, trace = optim.ema_momentum(0.9, nesterov), optim.trace(0.9, nesterov)
    params = tree.from_flat({"w": torch.zeros(5, 3)})
    s_ema, s_trace, m = ema.init(params), trace.init(params), torch.zeros(5, 3)
    for x in grads:
        m = 0.9 * m + 0.1 * x
        u, s_ema = ema.update(tree.from_flat({"w": x}), s_ema, params)
        t, s_trace = trace.update(tree.from_flat({"w": x}), s_trace, params)
        want = 0.1 * x + 0.9 * m if nesterov else m
        torch.testing.assert_close(u["w"], want)
        torch.testing.assert_close(u["w"], 0.1 * t["w"])


def test_a_schedule_runs_compiled_without_recompiling():
    model = tiny_gpt(n_layer=1)  # one block: dynamo traces each block's code anew
    opt = optim.muon_adamw(optim.linear_warmup(0.02, 3), weight_decay=0.1)
    eager = ft.train_step(lm_loss(model), opt)
    state = ft.TrainState.create(ft.params_of(model), opt)
    compiled = ft.compile(eager, backend="eager")
    state, metrics = assert_no_recompile(compiled, state, [lm_batch(2, i) for i in range(4)])
    torch.testing.assert_close(metrics[-1]["lr"], torch.tensor(0.02))
    assert metrics[0]["lr"] < metrics[1]["lr"] < metrics[2]["lr"]  # warming up: lr changed


# -- what Muon refuses -----------------------------------------------------------------------------


def test_params_that_are_not_matrices_are_named_with_the_fix():
    params = ft.params_of(tiny_gpt())
    with pytest.raises(ValueError, match=r"not 2-D: 'blocks.0.ln_1.weight' \(32,\).*muon_adamw"):
        optim.muon(0.02).init(params)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(momentum=1.0), "momentum must be a number in"),
        (dict(ns_steps=2.5), "ns_steps must be an int"),
        (dict(adjust_lr_fn="keller"), "'original', 'match_rms_adamw'"),
    ],
)
def test_bad_options_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        optim.muon(0.02, **kw)


# -- muon_adamw ------------------------------------------------------------------------------------


def shaped(names: dict[str, tuple]) -> ft.tree.TensorDict:
    return tree.from_flat({k: torch.zeros(s) for k, s in names.items()})


def test_default_labels_for_gpt_hf_gpt2_and_llama_names():
    def muon_params(params):
        labels = optim.muon_labels(params)
        return {k for k in tree.paths(params) if labels[tuple(k.split("."))] == "muon"}

    gpt = ft.params_of(tiny_gpt(tie_weights=False))
    assert muon_params(gpt) == {
        f"blocks.{i}.{m}.weight"
        for i in (0, 1)
        for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    }  # not wte, wpe, lm_head, norms, biases
    moe = ft.params_of(tiny_gpt(n_layer=1, n_experts=2))
    assert "blocks.0.mlp.w1" not in muon_params(moe)  # stacked experts (3-D): AdamW
    gpt2 = shaped({"transformer.wte.weight": (64, 8), "transformer.wpe.weight": (16, 8),
                   "transformer.h.0.attn.c_attn.weight": (8, 24), "transformer.h.0.ln_1.weight": (8,),
                   "transformer.h.0.mlp.c_proj.weight": (32, 8), "lm_head.weight": (64, 8)})  # fmt: skip
    assert muon_params(gpt2) == {
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.mlp.c_proj.weight",
    }
    llama = shaped({"model.embed_tokens.weight": (64, 8), "model.layers.0.self_attn.q_proj.weight": (8, 8),
                    "model.layers.0.mlp.down_proj.weight": (8, 16), "model.norm.weight": (8,),
                    "lm_head.weight": (64, 8)})  # fmt: skip
    assert muon_params(llama) == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    }
    custom = functools.partial(optim.muon_labels, exclude=(r"q_proj",))
    assert custom(llama)["model", "layers", "0", "self_attn", "q_proj", "weight"] == "adamw"
    assert custom(llama)["model", "embed_tokens", "weight"] == "muon"  # the default list replaced


def grads_of(model, params, batch) -> ft.tree.TensorDict:
    flat = {k: v.detach().requires_grad_() for k, v in tree.to_flat(params).items()}
    loss = lm_loss(model)(tree.from_flat(flat), batch)
    grads = torch.autograd.grad(loss.total / loss.count, list(flat.values()))
    return tree.from_flat(dict(zip(flat, grads)))


def test_muon_adamw_is_muon_on_the_hidden_matrices_and_adamw_on_the_rest():
    """Bit for bit: each part gets exactly what its optimizer alone gives its own params."""
    model = tiny_gpt()
    params = ft.params_of(model)
    names = set(hidden_names(model))

    def part(td, hidden):
        return tree.from_flat({k: v for k, v in tree.to_flat(td).items() if (k in names) == hidden})

    kw = dict(weight_decay=0.1, mask=optim.decay_mask)
    combined = optim.muon_adamw(0.02, 3e-3, **kw)
    alone = {
        True: optim.muon(0.02, adjust_lr_fn="match_rms_adamw", **kw),
        False: optim.adamw(3e-3, **kw),
    }
    state = combined.init(params)
    parts = {h: part(params, h) for h in alone}
    states = {h: alone[h].init(parts[h]) for h in alone}
    for i in range(5):
        grads = grads_of(model, params, lm_batch(4, seed=i))
        updates, state = combined.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        for h in alone:
            u, states[h] = alone[h].update(part(grads, h), states[h], parts[h])
            parts[h] = optim.apply_updates(parts[h], u)
    for h, key in ((True, "muon"), (False, "adamw")):
        flat = tree.to_flat(params)
        assert all(torch.equal(flat[k], v) for k, v in tree.to_flat(parts[h]).items())
        want = tree.to_flat(states[h])
        got = tree.to_flat(state[key])
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    flat, before = tree.to_flat(params), tree.to_flat(ft.params_of(model))
    assert all(not torch.equal(flat[k], before[k]) for k in names)  # Muon moved every matrix


def test_muon_adamw_takes_labels_and_names_what_is_wrong():
    params = shaped({"enc.weight": (8, 8), "enc.bias": (8,), "head.weight": (4, 8)})
    labels = tree.from_flat({"enc.weight": "muon", "enc.bias": "adamw", "head.weight": "adamw"})
    state = optim.muon_adamw(0.02, labels=labels).init(params)
    assert set(tree.paths(state["muon"])) == {"0.ema.enc.weight", "3.count", "3.lr"}
    missing = tree.from_flat({"enc.weight": "muon", "enc.bias": "adamw"})
    with pytest.raises(KeyError, match=r"no label for \['head.weight'\]"):
        optim.muon_adamw(0.02, labels=missing).init(params)
    typo = tree.from_flat({"enc.weight": "moun", "enc.bias": "adamw", "head.weight": "adamw"})
    with pytest.raises(KeyError, match=r"labels with no transform: 'moun' \(on \['enc.weight'\]"):
        optim.muon_adamw(0.02, labels=typo).init(params)
    not_matrix = tree.from_flat({"enc.weight": "muon", "enc.bias": "muon", "head.weight": "adamw"})
    with pytest.raises(ValueError, match="not 2-D: 'enc.bias'"):
        optim.muon_adamw(0.02, labels=not_matrix).init(params)


def test_the_cli_trains_with_muon(tmp_path, tiny_run):
    """`--optimizer muon` is the muon_adamw recipe, with the flags' learning rate and decay."""
    from ftrain.app.cli import main

    out = tmp_path / "run"
    argv = [
        *tiny_run,
        "--optimizer",
        "muon",
        "--max-steps",
        "6",
        "--warmup",
        "0",
        "--out",
        str(out),
    ]
    assert main(["train", *argv, "--lr", "0.01"]) == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"] and records[0]["lr"] == pytest.approx(0.01)
    state = ft.load(ft.latest_checkpoint(out))
    # inject_hyperparams' inner state; after clipping ("0"): muon_adamw's Muon part
    ema = state.opt_state["inner_state", "1", "muon", "0", "ema"]
    assert set(tree.paths(ema)) == {
        f"blocks.{i}.{m}.weight"
        for i in (0, 1)
        for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    }


# -- sharded: the session's 2-rank run (_two_ranks.py) ----------------------------------------------


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_sharded_muon_equals_ddp(two_ranks, strategy):
    """The orthogonalization sees whole matrices under every strategy (one of them split 17/16
    rows): the same params and state as ddp, on every rank."""
    for r in two_ranks:
        got, ddp = r["muon", strategy], r["muon", "ddp"]
        for part in ("params", "opt_state"):
            assert got[part].keys() == ddp[part].keys()
            for k in ddp[part]:
                assert max_rel_error(got[part][k], ddp[part][k]) <= 1e-6, (part, k)
        assert got["layouts"] == {"(Shard(dim=0),)"}  # the state stayed sharded


def test_other_layouts_are_orthogonalized_whole(two_ranks):
    """Columns split across ranks, or replicated: the result is Newton–Schulz of the whole matrix,
    laid out as the update came in."""
    want = optim.newton_schulz(torch.randn(5, 7, generator=torch.Generator().manual_seed(3)))
    for r in two_ranks:
        for placement in ("S(1)", "R"):
            placements, got = r["muon", placement]
            assert str(placements[0]) == placement
            assert torch.equal(got, want.float())
