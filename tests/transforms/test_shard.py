"""ft.shard (ftrain.transforms.shard): N ranks each given 1/N of the batch equal one process given
the whole batch, for every strategy, composed and with other optimizers; and its errors.

The ranks' results come from the session's one 2-rank run (``two_ranks`` in conftest.py, the
setting in ``_two_ranks.py``); the references are computed here, in one process.
"""

from __future__ import annotations

import pytest
import torch

import ftrain as ft
from ftrain.distributed import STRATEGIES, shard_state
from ftrain.testing import max_rel_error
from ftrain.transforms import shard

from _tiny import lm_loss
from _two_ranks import CONFIGS, OPTIMIZERS, batches, gpt, rows_of, run, sgd, whole


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
def test_n_ranks_on_parts_equal_one_process_on_the_whole_batch(
    two_ranks, references, name, strategy
):
    """3 steps, each rank holding half of an unevenly padded batch, equal 1 process (1e-5).
    "composed" is accumulate + checkpoint + autocast(bf16) on both sides. adafactor's factored
    statistics of a row-sharded matrix are reductions over the shards (out of place, and in place
    when donated)."""
    ref = references[name]
    for r in two_ranks:  # every rank ends with the same whole state
        got = r[name, strategy]
        assert_close(got["params"], ref["params"], 1e-5)
        assert_close(got["opt_state"], ref["opt_state"], 1e-5)
        # the loss and token count are those of the whole batch, not a mean of rank means
        assert got["metrics"]["count"] == ref["metrics"]["count"]
        assert max_rel_error(got["metrics"]["loss"], ref["metrics"]["loss"]) < 1e-6
        assert got["plain_metrics"]


@pytest.mark.parametrize("name", ["composed", "adamw", "fp16"])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_buckets_reduced_during_backward_give_the_bits_of_one_reduction_after_it(
    two_ranks, name, strategy
):
    """ddp/zero1/zero2 with bucket_mb (7 buckets, reduced as backward fills them) against
    bucket_mb=None (one all-reduce or reduce-scatter after backward): bitwise, under accumulate +
    checkpoint + autocast(bf16) ("composed"), donated AdamW with global-norm clipping ("adamw")
    and 2 micro-batches of fp16 with a dynamic loss scale ("fp16", each gradient multiplied by
    its micro-batch's count as it is handed over); and so with ft.offload("optimizer+gradients")
    inside or outside ft.shard, whose host copies (one buffer per param) follow each bucket's
    reduction."""
    for r in two_ranks:
        runs = r["buckets", name, strategy]
        want = runs["after backward"]
        buckets = runs["buckets"] if name == "fp16" else r[name, strategy]
        assert want["host copies"] == 0
        for variant, got in [("buckets", buckets), *runs.items()]:
            for part in ("params", "opt_state"):
                for k, t in want[part].items():
                    assert torch.equal(got[part][k], t), (variant, part, k)
            for k in ("loss", "count", "grad_norm"):
                assert torch.equal(got["metrics"][k], want["metrics"][k]), (variant, k)
        for variant in ("offload inside", "offload outside"):
            assert runs[variant]["host copies"] == len(want["params"]), variant


def test_the_reference_is_token_weighted():
    """Guards the test above: the two halves hold different numbers of tokens."""
    counts = [int((rows_of(b, r)["target"] != -100).sum()) for b in batches() for r in (0, 1)]
    assert counts[0] != counts[1]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_adamw_with_clipping_and_decay_mask(two_ranks, references, strategy):
    """Sharded optimizer state, global-norm clipping (a reduction over shards) and a weight-decay
    mask: the same as one process, and the same as ddp to float rounding."""
    got = two_ranks[0]["adamw", strategy]
    assert_close(got["params"], references["adamw"]["params"], 1e-5)
    assert_close(got["params"], two_ranks[0]["adamw", "ddp"]["params"], 2e-6)
    assert_close(got["opt_state"], two_ranks[0]["adamw", "ddp"]["opt_state"], 2e-6)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_other_optimizers_on_shards_match_ddp(two_ranks, name, strategy):
    """lion, adamw8bit and schedule_free_adamw are elementwise (the same bits); lamb's per-tensor norms are sums over
    shards (rounding)."""
    got, ddp = two_ranks[0]["optimizer", name, strategy], two_ranks[0]["optimizer", name, "ddp"]
    assert_close(got["params"], ddp["params"], 1e-6)
    assert_close(got["opt_state"], ddp["opt_state"], 1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp16_loss_scaling_matches_ddp_and_skips_overflow_everywhere(two_ranks, strategy):
    """fp16 backpropagates each rank's count-normalized loss; the gradients are weighted by the
    counts before any sum, so every strategy gives what ddp gives. An overflowing step (scale
    1e30) is skipped on every rank and changes nothing."""
    for r in two_ranks:
        got, skipped, before, after = r["fp16", strategy]
        ddp = r["fp16", "ddp"][0]
        assert_close(got["params"], ddp["params"], 1e-6)
        assert skipped
        for part in ("params", "opt_state"):
            assert all(torch.equal(before[part][k], after[part][k]) for k in before[part])


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


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), True, "25"])
def test_bucket_mb_must_be_a_positive_number_or_none(bad):
    """Refused when the step is built (before the process group is looked for)."""
    step = ft.train_step(lm_loss(gpt()), sgd())
    with pytest.raises(ValueError, match=r"bucket_mb=\.\.\.\): a number of MiB > 0 .* or None"):
        shard(step, "ddp", bucket_mb=bad)


def test_prefetch_must_be_a_bool():
    """Refused when the step is built (before the process group is looked for)."""
    step = ft.train_step(lm_loss(gpt()), sgd())
    with pytest.raises(TypeError, match=r"prefetch must be True or False, got 'yes'"):
        shard(step, "fsdp", prefetch="yes")


def test_a_state_not_laid_out_for_the_strategy_is_refused(two_ranks):
    for r in two_ranks:
        assert "ft.shard_state(state, 'fsdp')" in r["errors"]["unsharded state"]


def test_compile_and_fsdp_are_refused_when_the_step_is_built(two_ranks):
    """In either order, before any step runs; the error names both transforms and the fix."""
    compiled = ft.compile(ft.train_step(lm_loss(gpt()), sgd()))
    with pytest.raises(RuntimeError, match=r"ft\.shard: no torch\.distributed process group"):
        shard(compiled, "fsdp")  # without a process group, that is what it says first
    for r in two_ranks:
        message = r["errors"]["compile after fsdp"]
        assert message.startswith("ft.compile compiles the step and ft.shard cannot be traced")
        assert "ft.compile(ft.shard(step, 'zero2'))" in message
        assert "leave out ft.compile" in message
