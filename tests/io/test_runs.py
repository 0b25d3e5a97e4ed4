"""Tests for ftrain.io.runs: checkpoint-<step> folders, pruning, the newest valid checkpoint,
and a run killed with SIGKILL at random moments."""

import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
from tensordict import TensorDict

import ftrain as ft
from ftrain.io import (
    CheckpointWarning,
    latest_checkpoint,
    list_checkpoints,
    load,
    load_meta,
    save_checkpoint,
    tensorfile,
)


@pytest.fixture(scope="module")
def state():
    """A small state with optimizer moments (any state will do: the format has its own tests)."""
    params = TensorDict({"w": torch.randn(4, 3), "b": torch.zeros(3)}, batch_size=[])
    return ft.TrainState.create(params, ft.optim.adamw(1e-2))


def at_step(state, n):
    return state.replace(step=torch.tensor(n, dtype=torch.int64))


def flip_byte(file, offset_from_end=3):
    data = bytearray(file.read_bytes())
    data[-offset_from_end] ^= 0x01
    file.write_bytes(bytes(data))


# --- pruning and resuming ------------------------------------------------------------------------


def test_a_crash_while_writing_tensors_leaves_the_previous_checkpoint(tmp_path, state, monkeypatch):
    save_checkpoint(tmp_path, at_step(state, 2))
    real = tensorfile.write  # what ft.save writes each tensor file with

    def half_written(filename, tensors, metadata=None):
        real(filename, tensors, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(100)
        raise OSError("simulated crash")

    monkeypatch.setattr(tensorfile, "write", half_written)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(tmp_path, at_step(state, 3))
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path).name == "checkpoint-2"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-2"]


def test_save_checkpoint_keeps_the_last_k(tmp_path, state):
    for n in (1, 2, 3, 10, 11):
        save_checkpoint(tmp_path, at_step(state, n), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-10", "checkpoint-11"]
    path = save_checkpoint(tmp_path, at_step(state, 5), keep=2)  # resumed from an older one
    assert path.name == "checkpoint-5"  # the one just written is always kept
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-5", "checkpoint-11"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-11", "checkpoint-5"]
    for n in (20, 21):
        save_checkpoint(tmp_path, at_step(state, n), keep=None)
    assert len(list_checkpoints(tmp_path)) == 4
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        save_checkpoint(tmp_path, state, keep=0)


def test_latest_checkpoint_passes_over_broken_ones(tmp_path, state):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    for n in (1, 2, 3):
        save_checkpoint(tmp_path, at_step(state, n), keep=5)
    assert latest_checkpoint(tmp_path).name == "checkpoint-3"
    flip_byte(tmp_path / "checkpoint-3" / "params.safetensors")
    (tmp_path / "checkpoint-2" / "meta.json").unlink()
    (tmp_path / "checkpoint-4.tmp-0123abcd").mkdir()  # an interrupted save
    with pytest.warns(CheckpointWarning) as caught:
        found = latest_checkpoint(tmp_path)
    assert found.name == "checkpoint-1"
    assert load(found).step.item() == 1
    messages = "\n".join(str(w.message) for w in caught)
    assert "checkpoint-3/params.safetensors is damaged" in messages
    assert "checkpoint-2/meta.json is missing" in messages
    assert "checkpoint-4.tmp-0123abcd" in messages


def test_leftovers_of_interrupted_saves_and_deletes_are_recovered(tmp_path, state):
    for n in (1, 2):
        save_checkpoint(tmp_path, at_step(state, n), keep=None)
    # as left by a save of checkpoint-2 killed between its renames, a delete killed mid-way and
    # a save killed while writing
    os.replace(tmp_path / "checkpoint-2", tmp_path / "checkpoint-2.old-00000001")
    (tmp_path / "checkpoint-3.del-00000002").mkdir()
    (tmp_path / "checkpoint-4.tmp-00000003").mkdir()
    with pytest.warns(CheckpointWarning) as caught:
        found = latest_checkpoint(tmp_path)
    assert found.name == "checkpoint-2.old-00000001" and load(found).step.item() == 2
    messages = "\n".join(str(w.message) for w in caught)
    assert "checkpoint-3.del-00000002" in messages and "checkpoint-4.tmp-00000003" in messages
    save_checkpoint(tmp_path, at_step(state, 5), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-5"]
    assert load(tmp_path / "checkpoint-2").step.item() == 2


# --- kill -9 -------------------------------------------------------------------------------------

# Imports torch once, then per "go" line forks a child that resumes from the newest checkpoint and,
# every iteration, saves a new run checkpoint and replaces the fixed checkpoint LAST, until the
# test kills it with SIGKILL.
ZYGOTE = textwrap.dedent(
    """
    import os, sys, traceback
    import torch
    from tensordict import NonTensorData, TensorDict
    import ftrain as ft
    from ftrain.io import latest_checkpoint, load, save, save_checkpoint

    torch.set_num_threads(1)
    run_dir, last = sys.argv[1:]
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                path = latest_checkpoint(run_dir)
                if path is None:
                    params = TensorDict({"w": torch.zeros(512, 1024)}, batch_size=[])
                    state = ft.TrainState.create(params, ft.optim.adamw(1e-3))
                else:
                    state = load(path)
                while True:
                    n = int(state.step) + 1
                    state = ft.TrainState(
                        params=state.params.apply(lambda t: torch.full_like(t, float(n))),
                        opt_state=state.opt_state,
                        step=torch.tensor(n),
                        rng=state.rng,
                        extra=state.extra,
                        batch_size=[],
                    )
                    save_checkpoint(run_dir, state, keep=2, extra={"step": n})
                    save(state, last, extra={"step": n})
                    print("saved", n, flush=True)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        print("child", pid, flush=True)
        os.waitpid(pid, 0)
        print("dead", flush=True)
    """
)


def assert_whole(path, newer_than):
    """The checkpoint at ``path`` verifies, holds what the loop saved, and is not older than
    ``newer_than``. Returns its step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)  # passed-over leftovers
        state, meta = load(path), load_meta(path)
    n = int(state.step)
    assert n >= newer_than and meta["step"] == n and meta["extra"] == {"step": n}
    assert torch.equal(state.params["w"], torch.full((512, 1024), float(n)))
    return n


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork and SIGKILL")
def test_kill_9_at_random_moments_always_leaves_a_valid_checkpoint(tmp_path):
    run_dir, last = tmp_path / "run", tmp_path / "last"
    zygote = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE, str(run_dir), str(last)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(120, zygote.kill)  # a hung child fails the test, never stalls it
    watchdog.start()
    rng = random.Random(0)
    run_step = last_step = 0
    child = None
    try:
        for _ in range(5):
            zygote.stdin.write("go\n")
            zygote.stdin.flush()
            kind, child = zygote.stdout.readline().split()
            assert kind == "child"
            child = int(child)
            line = zygote.stdout.readline()  # the child's first save after resuming
            assert line.startswith("saved"), line
            time.sleep(rng.uniform(0.0, 0.2))
            os.kill(child, signal.SIGKILL)
            while (line := zygote.stdout.readline()).startswith("saved"):
                pass
            assert line == "dead\n", line
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CheckpointWarning)
                path = latest_checkpoint(run_dir)
            assert path is not None
            run_step = assert_whole(path, newer_than=run_step + 1)  # resumed, saved at least once
            last_step = assert_whole(last, newer_than=last_step)  # replaced in place, never torn
    finally:
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        watchdog.cancel()
        zygote.kill()
        zygote.wait()


def test_save_checkpoint_refuses_extra_beside_a_snapshot(tmp_path):
    from ftrain.io.checkpoint import snapshot

    state = ft.TrainState.create(ft.params_of(torch.nn.Linear(2, 2)), ft.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"a Snapshot carries its extra already"):
        ft.save_checkpoint(tmp_path, snapshot(state, {"a": 1}), extra={"b": 2})
