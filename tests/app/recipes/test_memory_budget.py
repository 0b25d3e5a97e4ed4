"""--memory-budget: the recipe's settings fitted by ft.fit, rows per step kept."""

import pytest

from ftrain.app.cli import parser
from ftrain.app.config import TrainConfig, from_args
from ftrain.app.recipes.memory_budget import budget_bytes, fit_config


def small(**kw):
    return TrainConfig(seq_len=64, d_model=64, n_layer=2, batch_size=8, micro_batches=2, **kw)


def test_the_fitted_config_fits_and_keeps_the_rows():
    roomy, report = fit_config(small(memory_budget="1GiB"))
    assert (roomy.micro_batches, roomy.batch_size, roomy.checkpoint_policy) == (1, 16, "none")
    tight_budget = int(report.memory.peak * 0.7)
    tight, report = fit_config(small(memory_budget=str(tight_budget)))
    assert report.memory.peak <= tight_budget
    assert tight.batch_size * tight.micro_batches == 16
    assert (tight.micro_batches, tight.checkpoint_policy, tight.precision) != (1, "none", "fp32")


def test_the_flag_is_checked_and_nothing_fitting_exits_with_the_reason():
    ns = parser().parse_args(["train", "--memory-budget", "4GiB"])
    assert from_args(ns).memory_budget == "4GiB"
    with pytest.raises(ValueError, match="memory-budget"):
        small(memory_budget="lots").validate()
    with pytest.raises(SystemExit, match="smallest predicted peak"):
        fit_config(
            TrainConfig(seq_len=16, d_model=32, n_layer=1, batch_size=1, memory_budget="1KiB")
        )
    assert budget_bytes("2MiB") == 2 * 2**20
