"""Background saves (ftrain.io.background.SaveHandle, through ``ft.save(..., blocking=False)``)."""

from __future__ import annotations

import pytest

import ftrain as ft
from ftrain import tree

from _sharded_ranks import differing, whole_state


def test_background_save_commits_the_state_of_the_call(tmp_path):
    """``blocking=False`` copies the state first: changing it in place after the call does not
    change what is written; ``wait()`` returns the path; the error of a failed write is raised
    by ``wait()``."""
    state = whole_state("adamw", steps=1)
    expected = ft.load(ft.save(state, tmp_path / "ref"))
    handle = ft.save(state, tmp_path / "bg", blocking=False)
    for t in tree.leaves(state.params):
        t.add_(1.0)
    assert handle.wait() == tmp_path / "bg"
    assert differing(ft.load(tmp_path / "bg"), expected) == []
    (tmp_path / "file").write_text("not a checkpoint dir")
    bad = ft.save(expected, tmp_path / "file", blocking=False)
    with pytest.raises(ft.CheckpointError, match="not a directory"):
        bad.wait()
