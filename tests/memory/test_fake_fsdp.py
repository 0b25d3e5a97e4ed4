"""ft.memory under shard("fsdp"), on 2 gloo ranks (conftest.py's memory_ranks, run by
_memory_ranks.py): the predicted peak against the measured one (ftrain.testing.peak_bytes) over
micro-batches x checkpoint policy x precision (fp16's Partial gradients included); planning
sends nothing; the state planned as shard_state lays it out, also from meta params alone;
ft.fit's choice measured under the budget and the faster option it rejected over it."""

import pytest

from _memory_ranks import FSDP


@pytest.mark.parametrize("config", FSDP, ids=str)
def test_predicted_peak_within_10_percent_on_each_rank(memory_ranks, config):
    for out in memory_ranks:
        predicted, measured = out["fsdp"][config]
        assert abs(predicted / measured - 1) < 0.10, (config, predicted, measured)


def test_planning_sends_nothing_and_lays_the_state_out_as_shard_state(memory_ranks):
    assert [out["alone"] for out in memory_ranks] == [3.0, 3.0]
    for out in memory_ranks:
        layout = out["layout"]
        planned, held = layout["params"]
        assert planned == held > 0
        planned, held = layout["optimizer"]
        assert planned == held > 0
        assert layout["world_size"] == 2
        from_meta, from_state = layout["from_meta"]
        assert from_meta == from_state


def test_fit_under_fsdp_chooses_what_measures_under_the_budget(memory_ranks):
    for out in memory_ranks:
        fit = out["fit"]
        assert fit["strategies"] == {"fsdp"}
        assert fit["chosen"].fits and fit["chosen"].peak <= fit["budget"]
        assert fit["rejected_fit"] and not any(fit["rejected_fit"])
        assert fit["chosen_measured"] <= fit["budget"] < fit["nearest_measured"]
