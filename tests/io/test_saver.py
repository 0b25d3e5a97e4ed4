"""``ft.Saver``: one background save at a time (ftrain.io.saver)."""

from __future__ import annotations

import pytest
import torch

import ftrain as ft

from _sharded_ranks import whole_state


def test_saver_waits_for_the_previous_save_and_raises_its_error(tmp_path):
    state = whole_state("adamw", steps=1)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    saver = ft.Saver()
    saver.save(state, tmp_path / "taken")  # refused in the background: holds a foreign file
    with pytest.raises(ft.CheckpointError, match="refusing to replace"):
        saver.save(state, tmp_path / "next")  # the next save raises the previous one's error
    with ft.Saver() as saver:
        for n in (1, 2, 3):
            saver.save_checkpoint(tmp_path / "run", state.replace(step=torch.tensor(n)), keep=2)
    assert [p.name for p in ft.list_checkpoints(tmp_path / "run")] == [
        "checkpoint-2",
        "checkpoint-3",
    ]


def test_a_failed_save_is_reported_when_leaving_on_another_error(tmp_path):
    """Leaving the block on an error keeps that error and warns that the last save failed."""
    state = whole_state("adamw", steps=1)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.warns(RuntimeWarning, match="the last save failed too"):
        with pytest.raises(KeyError, match="the step's own error"):
            with ft.Saver() as saver:
                saver.save(state, tmp_path / "taken")
                raise KeyError("the step's own error")
