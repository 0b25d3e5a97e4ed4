"""ft.fit: the chosen composition measures under the budget, the faster one it rejected over it."""

import pytest
import torch

import ftrain as ft
from ftrain.testing import peak_bytes

from _tiny import lm_batch, lm_loss, tiny_gpt


def setup(rows=16):
    model = tiny_gpt(d_model=64, n_layer=3, seq_len=32)
    opt = ft.optim.adamw(1e-3)
    step = ft.train_step(lm_loss(model), opt)
    state = ft.TrainState.create(ft.params_of(model), opt)
    return step, state, lm_batch(rows, length=32)


def test_the_choice_fits_and_the_faster_rejected_one_does_not():
    step, state, batch = setup()
    whole = ft.memory(step, state, batch).peak
    budget = int(whole * 0.75)
    new, report = ft.fit(step, state, batch, budget)
    assert report.chosen.fits and report.memory.peak <= budget
    assert peak_bytes(new, state, batch) <= budget
    rejected = [c for c in report.candidates[: report.candidates.index(report.chosen)]]
    assert rejected and not any(c.fits for c in rejected)
    nearest = rejected[-1]  # the next faster composition: it was predicted not to fit
    bigger = _build(step, nearest)
    assert peak_bytes(bigger, state, batch) > budget
    assert "chose" in str(report) and report.reason
    # the chosen step trains like the original: same loss on the same batch
    _, m_new = new(state, batch)
    _, m_old = step(state, batch)
    assert torch.allclose(m_new["loss"], m_old["loss"], rtol=2e-2)


def _build(step, c):
    """The composition ``c`` built with the public transforms."""
    if c.precision == "bf16":
        step = ft.autocast(step, torch.bfloat16)
    if c.policy != "none":
        step = ft.checkpoint(step, c.policy)
    if c.micro_batches > 1:
        step = ft.accumulate(step, c.micro_batches)
    return step


def test_a_roomy_budget_keeps_the_fastest_and_strings_are_budgets():
    step, state, batch = setup(rows=4)
    new, report = ft.fit(step, state, batch, "1GiB")
    assert report.budget == 2**30
    assert (report.chosen.micro_batches, report.chosen.policy, report.chosen.precision) == (
        1,
        "none",
        "fp32",
    )
    assert new.transforms == ()


def test_an_fp16_choice_is_a_step_with_its_loss_scale_that_runs():
    step, state, batch = setup(rows=4)
    new, report = ft.fit(step, state, batch, "1GiB", precisions=("fp16",))
    assert report.chosen.precision == "fp16"
    rows = {r.hook: r.transforms for r in new.explain_rows()}
    assert rows["loss_scale"] == ("autocast",)  # fp16 keeps its loss scale
    _, metrics = new(state, batch)
    assert torch.isfinite(metrics["loss"])


def test_user_transforms_are_kept_and_the_old_composition_replaced():
    step, state, batch = setup(rows=8)
    marked = ft.accumulate(ft.checkpoint(ft.ema(step, 0.9), "blocks"), 2)
    new, report = ft.fit(marked, state, batch, 10**9)
    assert new.names == ("ema",)


def test_nothing_fits_names_the_smallest_peak_and_the_budget():
    step, state, batch = setup(rows=4)
    with pytest.raises(MemoryError, match=r"budget of 1000 B.*smallest predicted peak is"):
        ft.fit(step, state, batch, 1000, micro_batches=(1, 4))
    with pytest.raises(ValueError, match="4GiB"):
        ft.fit(step, state, batch, "four gigs")
    with pytest.raises(ValueError, match="legal policies"):
        ft.fit(step, state, batch, "1GiB", policies=("all",))


def test_offload_is_reached_only_when_nothing_on_the_device_fits():
    step, state, batch = setup(rows=4)
    plain = ft.memory(step, state, batch, device="cuda")
    moved = ft.memory(ft.offload(step), state, batch, device="cuda")
    assert moved.peak < plain.peak
    # a budget between the offloaded step's device peak and the smallest plan on the device
    budget = moved.peak + 1
    kept = dict(micro_batches=(1,), policies=("none",), precisions=("fp32",), device="cuda")
    new, report = ft.fit(step, state, batch, budget, **kept)
    assert report.chosen.offload == "optimizer" and report.memory.host_optimizer > 0
    assert [c.offload for c in report.candidates] == ["none", "optimizer"]
    assert "offload=optimizer" in str(report) and "host peak" in str(report)
    assert "offload" in new.names
    # a roomy budget never plans offload; on a CPU plan it is not considered at all
    _, roomy = ft.fit(step, state, batch, plain.peak, **kept)
    assert {c.offload for c in roomy.candidates} == {"none"}
    with pytest.raises(MemoryError):
        ft.fit(step, state, batch, budget, micro_batches=(1,), policies=("none",))
    if not torch.cuda.is_available():  # bf16 cannot run on the meta stand-in: refused up front
        with pytest.raises(ValueError, match="precisions=\\('fp32',\\)"):
            ft.fit(step, state, batch, budget, device="cuda")
