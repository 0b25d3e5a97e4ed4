"""tensor_parallel.sequence_region: where sequence parallelism splits the sequence and which
gradients it sums (one process; the multi-rank equality with one process is in
test_transforms_tensor_parallel.py)."""

import pytest

from ftrain.distributed.tensor_parallel.plans import (
    SequenceParallel,
    gpt_plan,
    hf_llama_plan,
    resolve_plan,
)
from ftrain.distributed.tensor_parallel.sequence_region import partial_params, region
from tests._tiny import tiny_gpt


def test_the_region_is_the_outermost_blocks_in_order():
    model = tiny_gpt(n_layer=3)
    assert region(model, gpt_plan()) == ["blocks.0", "blocks.1", "blocks.2"]
    assert region(model, {"blocks.*": SequenceParallel(), "ln_f": SequenceParallel()})[-1] == "ln_f"


def test_a_region_that_skips_a_module_is_refused():
    """blocks.1 would run between the split and the gather, on slices, its norms' partial
    gradients never summed (0.006 from one process after 3 steps, found in review)."""
    model = tiny_gpt(n_layer=3)
    with pytest.raises(ValueError, match=r"skips \['blocks.1'\]"):
        region(model, {"blocks.[02]": SequenceParallel()})


def test_partial_params_are_the_whole_ones_inside_the_blocks():
    model = tiny_gpt(n_layer=2)
    names = region(model, gpt_plan())
    got = partial_params(model, names, resolve_plan(model, gpt_plan(), 2))
    want = {
        f"blocks.{i}.{p}"
        for i in range(2)
        for p in (
            "ln_1.weight",
            "ln_1.bias",
            "ln_2.weight",
            "ln_2.bias",
            "attn.proj.bias",  # row-parallel: added after the reduce-scatter
            "mlp.proj.bias",
        )
    }
    assert got == want  # not the split matrices, the column biases, wte or ln_f


def test_a_plan_without_a_region_is_refused():
    model = tiny_gpt()
    plan = {k: v for k, v in gpt_plan().items() if not isinstance(v, SequenceParallel)}
    with pytest.raises(ValueError, match="marks no module SequenceParallel"):
        region(model, plan)
    assert not any(isinstance(s, SequenceParallel) for s in hf_llama_plan().values())
