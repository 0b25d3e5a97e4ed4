"""ft.shard on 2 CPU processes (gloo): every strategy equals one process on the whole batch.

Starting processes that import torch costs seconds, so one ``run_distributed`` call runs every
check (:func:`_on_two_ranks`) and returns what the tests below compare, in the parent, against
single-process references.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ftrain as ft
from ftrain import tree
from ftrain.distributed import (
    STRATEGIES,
    DistributedError,
    local_bytes,
    run_distributed,
    shard_state,
    track_gathered,
    unshard,
    unshard_state,
)
from ftrain.models import GPT, GPTConfig
from ftrain.testing import max_rel_error
from ftrain.transforms import shard
from ftrain.transforms.autocast import StaticLossScale

WORLD = 2
ROWS = 4  # global batch; each rank gets ROWS // WORLD rows
STEPS = 3


# -- the setting, the same in the parent and in the ranks -----------------------------------------


def gpt(n_layer=2, **kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layer=n_layer, n_head=2, **kw))


def lm_loss(model):
    def loss_fn(params, batch):
        return ft.losses.cross_entropy(ft.apply(model, params, batch["input"]), batch["target"])

    return loss_fn


def batches(steps=STEPS) -> list[dict[str, torch.Tensor]]:
    """Token batches padded unevenly: rank 0's rows hold far fewer valid tokens than rank 1's,
    so a mean of per-rank means would be wrong."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 64, (ROWS, 8), generator=g)
        y = torch.randint(0, 64, (ROWS, 8), generator=g)
        y[0, 2:] = -100
        y[1, 5:] = -100
        out.append({"input": x, "target": y})
    return out


def rows_of(batch, rank):
    per = ROWS // WORLD
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}


def sgd():
    return ft.optim.sgd(0.5, momentum=0.9)


def adamw():
    return ft.optim.chain(
        ft.optim.clip_by_global_norm(0.5),
        ft.optim.adamw(1e-3, weight_decay=0.1, mask=ft.optim.decay_mask),
    )


def adafactor():
    return ft.optim.adafactor(1e-2, weight_decay=0.1)


def composed(step, micro_batches):
    return ft.accumulate(ft.checkpoint(ft.autocast(step, torch.bfloat16)), micro_batches)


def _optimizers():
    from ftrain.optim.lamb import lamb
    from ftrain.optim.quantized import adamw8bit

    return {
        "lion": lambda: ft.optim.lion(1e-4, weight_decay=0.1),
        "lamb": lambda: lamb(1e-3),
        "adamw8bit": lambda: adamw8bit(1e-3),
    }


OPTIMIZERS = _optimizers()

CONFIGS = {
    # name: (optimizer, model options, transforms on the sharded step, on the 1-process step)
    "sgd": (sgd, {}, lambda s: s, lambda s: s),
    "composed": (sgd, {}, lambda s: composed(s, 2), lambda s: composed(s, 4)),
    # bias=False: the key bias of attention has a zero gradient in exact arithmetic, which
    # Adam would turn into rounding noise of the size of the learning rate.
    "adamw": (adamw, {"bias": False}, lambda s: s, lambda s: s),
    # factored second moments: a matrix's column statistic is a mean over every process's rows
    "adafactor": (adafactor, {"bias": False}, lambda s: s, lambda s: s),
    "adafactor, donated": (adafactor, {"bias": False}, lambda s: s, lambda s: s),
}
DONATED = ("adamw", "adafactor, donated")  # in place, as the CLI runs them


def run(step, state, data, rank=None):
    for b in data:
        state, metrics = step(state, b if rank is None else rows_of(b, rank))
    return state, metrics


def whole(state):
    return {
        "params": tree.to_flat(state.params),
        "opt_state": tree.to_flat(state.opt_state),
    }


def layouts(td) -> set[str]:
    """How the tensors of ``td`` with one or more dims are laid out: "plain" or placements."""
    return {
        repr(tuple(t.placements)) if hasattr(t, "placements") else "plain"
        for t in tree.leaves(td)
        if t.dim() > 0
    }


# -- what the two ranks do -----------------------------------------------------------------------


RESUMED = [("adamw", "zero2"), ("adamw", "fsdp"), ("adafactor", "zero1"), ("adafactor", "fsdp")]


def _on_two_ranks(tmp: str) -> dict:
    rank = dist.get_rank()
    out: dict = {"rank": rank}
    data = batches()

    # 1. every strategy, every config: STEPS steps on this rank's rows
    for name, (make_opt, model_kw, transform, _) in CONFIGS.items():
        for strategy in STRATEGIES:
            model, opt = gpt(**model_kw), make_opt()
            step = shard(
                transform(ft.train_step(lm_loss(model), opt, donate=name in DONATED)), strategy
            )
            state = shard_state(ft.TrainState.create(ft.params_of(model), opt), strategy)
            state, metrics = run(step, state, data, rank)
            out[name, strategy] = {
                "layouts": layouts(state.opt_state),
                **whole(unshard_state(state)),
                "metrics": {k: v.clone() for k, v in metrics.items()},
                "param_bytes": local_bytes(state.params),
                "opt_bytes": local_bytes(state.opt_state),
                "plain_metrics": all(type(v) is torch.Tensor for v in metrics.values()),
            }

    # 2. fsdp holds whole params one block at a time (4 blocks), with and without checkpoint
    for name, transform in (("fsdp", lambda s: s), ("fsdp+checkpoint", ft.checkpoint)):
        model = gpt(n_layer=4)
        step = shard(transform(ft.train_step(lm_loss(model), sgd())), "fsdp")
        state = shard_state(ft.TrainState.create(ft.params_of(model), sgd()), "fsdp")
        state, _ = step(state, rows_of(data[0], rank))  # warm up
        with track_gathered() as t:
            state, _ = step(state, rows_of(data[1], rank))
        out["peak", name] = (t.peak, t.gathers)

    # 3. save (whole, from rank 0) after 2 steps, load on every rank, 1 more step
    for name, strategy in RESUMED:
        model, make_opt = gpt(), {"adamw": adamw, "adafactor": adafactor}[name]
        step = shard(ft.train_step(lm_loss(model), make_opt()), strategy)
        state = shard_state(ft.TrainState.create(ft.params_of(model), make_opt()), strategy)
        state, _ = run(step, state, data[:2], rank)
        path = f"{tmp}/{name}-{strategy}"
        saved = unshard_state(state)
        if rank == 0:
            ft.save(saved, path)
        dist.barrier()
        resumed = shard_state(ft.load(path, like=saved), strategy)
        resumed, _ = run(step, resumed, data[2:], rank)
        straight, _ = run(step, state, data[2:], rank)
        out["resume", name, strategy] = (
            whole(unshard_state(resumed)),
            whole(unshard_state(straight)),
        )

    # 4. more optimizers: the math on shards against the same math under ddp
    for name, make_opt in OPTIMIZERS.items():
        for strategy in STRATEGIES:
            model, opt = gpt(bias=False), make_opt()
            step = shard(ft.train_step(lm_loss(model), opt), strategy)
            state = shard_state(ft.TrainState.create(ft.params_of(model), opt), strategy)
            state, _ = run(step, state, data[:2], rank)
            out["optimizer", name, strategy] = whole(unshard_state(state))

    # 5. fp16 loss scaling: the same as ddp; an overflow is skipped on every rank
    for strategy in STRATEGIES:
        model = gpt()
        step = shard(ft.autocast(ft.train_step(lm_loss(model), sgd()), torch.float16), strategy)
        state = step.init_extra(ft.TrainState.create(ft.params_of(model), sgd()))
        state, _ = run(step, shard_state(state, strategy), data, rank)
        huge = StaticLossScale(1e30)
        step = shard(
            ft.autocast(ft.train_step(lm_loss(model), sgd()), torch.float16, loss_scale=huge),
            strategy,
        )
        before = shard_state(
            step.init_extra(ft.TrainState.create(ft.params_of(model), sgd())), strategy
        )
        after, metrics = step(before, rows_of(data[0], rank))
        out["fp16", strategy] = (
            whole(unshard_state(state)),
            bool(metrics["skipped"]),
            whole(unshard_state(before)),
            whole(unshard_state(after)),
        )

    # 6. mistakes that are caught
    errors = {}
    model = gpt()
    plain = ft.TrainState.create(ft.params_of(model), sgd())
    step = shard(ft.train_step(lm_loss(model), sgd()), "fsdp")
    try:
        step(plain, rows_of(data[0], rank))
    except ValueError as e:
        errors["unsharded state"] = str(e)
    skewed = plain.replace(params=plain.params.apply(lambda t: t + rank))
    try:
        shard_state(skewed, "zero1")
    except ValueError as e:
        errors["params differ"] = str(e)
    try:
        ft.compile(shard(ft.train_step(lm_loss(model), sgd()), "fsdp"))
    except ValueError as e:
        errors["compile after fsdp"] = str(e)
    for strategy in ("ddp", "zero1", "zero2"):  # these compile (built here, not run)
        ft.compile(shard(ft.train_step(lm_loss(model), sgd()), strategy))
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_on_two_ranks, WORLD, str(tmp_path_factory.mktemp("shard")))


@pytest.fixture(scope="module")
def references():
    """One process on the whole batch, per config."""
    refs = {}
    data = batches()
    for name, (make_opt, model_kw, _, transform) in CONFIGS.items():
        model, opt = gpt(**model_kw), make_opt()
        step = transform(ft.train_step(lm_loss(model), opt))
        state, metrics = run(step, ft.TrainState.create(ft.params_of(model), opt), data)
        refs[name] = {**whole(state), "metrics": metrics}
    return refs


def assert_close(actual: dict, expected: dict, rtol: float) -> None:
    assert actual.keys() == expected.keys()
    for k in expected:
        err = max_rel_error(actual[k], expected[k])
        assert err <= rtol, f"{k}: relative error {err:.2e} > {rtol:.0e}"


# -- the invariant ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sgd", "composed", "adafactor", "adafactor, donated"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_n_ranks_on_parts_equal_one_process_on_the_whole_batch(ranks, references, name, strategy):
    """3 steps, each rank holding half of an unevenly padded batch, equal 1 process (1e-5).
    "composed" is accumulate + checkpoint + autocast(bf16) on both sides. adafactor's factored
    statistics of a row-sharded matrix are reductions over the shards (out of place, and in place
    when donated)."""
    ref = references[name]
    for r in ranks:  # every rank ends with the same whole state
        got = r[name, strategy]
        assert_close(got["params"], ref["params"], 1e-5)
        assert_close(got["opt_state"], ref["opt_state"], 1e-5)
        # the loss and token count are those of the whole batch, not a mean of rank means
        assert got["metrics"]["count"] == ref["metrics"]["count"]
        assert max_rel_error(got["metrics"]["loss"], ref["metrics"]["loss"]) < 1e-6
        assert got["plain_metrics"]


def test_the_reference_is_token_weighted(references):
    """Guards the test above: the two halves hold different numbers of tokens."""
    counts = [int((rows_of(b, r)["target"] != -100).sum()) for b in batches() for r in (0, 1)]
    assert counts[0] != counts[1]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_optimizer_state_keeps_the_layout_shard_state_gave_it(ranks, name, strategy):
    """After several steps the optimizer state is still laid out as shard_state laid it out:
    plain under ddp, Shard(0) rows otherwise. (adafactor's new column statistic is a reduction
    over the shards, which DTensor returns Replicate(); the step puts it back.)"""
    expected = {"plain"} if strategy == "ddp" else {"(Shard(dim=0),)"}
    for r in ranks:
        assert r[name, strategy]["layouts"] == expected


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_adamw_with_clipping_and_decay_mask(ranks, references, strategy):
    """Sharded optimizer state, global-norm clipping (a reduction over shards) and a weight-decay
    mask: the same as one process, and the same as ddp to float rounding."""
    got = ranks[0]["adamw", strategy]
    assert_close(got["params"], references["adamw"]["params"], 1e-5)
    assert_close(got["params"], ranks[0]["adamw", "ddp"]["params"], 2e-6)
    assert_close(got["opt_state"], ranks[0]["adamw", "ddp"]["opt_state"], 2e-6)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_other_optimizers_on_shards_match_ddp(ranks, name, strategy):
    """lion and adamw8bit are elementwise (the same bits); lamb's per-tensor norms are sums over
    shards (rounding)."""
    got, ddp = ranks[0]["optimizer", name, strategy], ranks[0]["optimizer", name, "ddp"]
    assert_close(got["params"], ddp["params"], 1e-6)
    assert_close(got["opt_state"], ddp["opt_state"], 1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp16_loss_scaling_matches_ddp_and_skips_overflow_everywhere(ranks, strategy):
    """fp16 backpropagates each rank's count-normalized loss; the gradients are weighted by the
    counts before any sum, so every strategy gives what ddp gives. An overflowing step (scale
    1e30) is skipped on every rank and changes nothing."""
    for r in ranks:
        got, skipped, before, after = r["fp16", strategy]
        ddp = r["fp16", "ddp"][0]
        assert_close(got["params"], ddp["params"], 1e-6)
        assert skipped
        for part in ("params", "opt_state"):
            assert all(torch.equal(before[part][k], after[part][k]) for k in before[part])


# -- memory ----------------------------------------------------------------------------------------


def test_optimizer_state_and_params_bytes_per_rank(ranks):
    """zero1/zero2/fsdp hold about half the optimizer state per rank; fsdp half the params."""
    for r in ranks:
        ddp = r["sgd", "ddp"]
        for strategy in STRATEGIES:
            got = r["sgd", strategy]
            opt_ratio = got["opt_bytes"] / ddp["opt_bytes"]
            param_ratio = got["param_bytes"] / ddp["param_bytes"]
            if strategy == "ddp":
                continue
            assert 0.4 < opt_ratio < 0.6, (strategy, opt_ratio)
            assert (0.4 < param_ratio < 0.6) if strategy == "fsdp" else param_ratio == 1.0


@pytest.mark.parametrize("name", ["fsdp", "fsdp+checkpoint"])
def test_fsdp_holds_the_shard_plus_one_block(ranks, name):
    """The whole params alive at any moment: the params outside the blocks plus one block."""
    model = gpt(n_layer=4)
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    rest = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
    total = sum(p.numel() * 4 for p in model.parameters())
    for r in ranks:
        peak, gathers = r["peak", name]
        assert gathers > 0
        assert peak <= rest + block, (peak, rest, block)
        assert peak < 0.35 * total


# -- save and resume -------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "strategy"), RESUMED)
def test_save_then_resume_continues_exactly(ranks, name, strategy):
    for r in ranks:
        resumed, straight = r["resume", name, strategy]
        for part in ("params", "opt_state"):
            for k in straight[part]:
                assert torch.equal(resumed[part][k], straight[part][k]), k


def test_a_sharded_checkpoint_loads_whole_in_one_process(ranks, tmp_path_factory):
    """The checkpoint holds whole tensors: it loads without a process group, and shard_state
    would lay it out for any number of processes."""
    root = tmp_path_factory.getbasetemp()
    path = next(root.glob("shard*/adamw-fsdp"))
    state = ft.load(path)
    assert all(type(t) is torch.Tensor for t in tree.leaves(state.params))
    assert int(state.step) == 2
    assert tree.to_flat(state.params).keys() == tree.to_flat(ft.params_of(gpt())).keys()


# -- mistakes --------------------------------------------------------------------------------------


def test_shard_without_a_process_group_says_how_to_launch():
    step = ft.train_step(lm_loss(gpt()), sgd())
    with pytest.raises(RuntimeError, match="torchrun.*ft.distributed.init"):
        shard(step, "fsdp")
    state = ft.TrainState.create(ft.params_of(gpt()), sgd())
    with pytest.raises(RuntimeError, match="run_distributed"):
        shard_state(state, "zero1")


def test_unknown_strategy_lists_the_legal_ones():
    step = ft.train_step(lm_loss(gpt()), sgd())
    with pytest.raises(ValueError, match="'ddp', 'zero1', 'zero2', 'fsdp'"):
        shard(step, "zero3")


def test_unsharded_state_and_differing_params_are_caught(ranks):
    for r in ranks:
        assert "ft.shard_state(state, 'fsdp')" in r["errors"]["unsharded state"]
        assert "differ between processes" in r["errors"]["params differ"]


def test_compile_and_fsdp_are_refused_when_the_step_is_built(ranks):
    """In either order, before any step runs; the error names both transforms and the fix."""
    compiled = ft.compile(ft.train_step(lm_loss(gpt()), sgd()))
    with pytest.raises(
        ValueError,
        match=r"(?s)^ft\.compile cannot compile a step with ft\.shard: .*fsdp.*"
        r"ft\.compile\(ft\.shard\(step, 'zero2'\)\).*leave out ft\.compile",
    ):
        shard(compiled, "fsdp")  # refused before it looks for a process group
    for r in ranks:
        message = r["errors"]["compile after fsdp"]
        assert message.startswith("ft.compile cannot compile a step with ft.shard: ")
        assert "ft.compile(ft.shard(step, 'zero2'))" in message
        assert "leave out ft.compile" in message


def test_shard_outside_a_step_needs_nothing_from_the_ranks():
    """unshard and local_bytes on a plain tree are no-ops (no process group needed)."""
    params = ft.params_of(gpt())
    assert unshard(params) is params
    assert local_bytes(params) == sum(t.numel() * 4 for t in tree.leaves(params))


def _fails_on_rank_1():
    if dist.get_rank() == 1:
        raise KeyError("only on rank 1")
    dist.barrier()  # rank 0 waits for a rank that never comes: it is stopped
    return "unreachable"


def test_run_distributed_reports_the_failing_rank_with_its_traceback():
    with pytest.raises(DistributedError, match=r"(?s)rank 1 ---\nKeyError.*only on rank 1"):
        run_distributed(_fails_on_rank_1, 2, timeout=120)
