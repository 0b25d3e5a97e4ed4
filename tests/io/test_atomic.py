"""Tests for ftrain.io.atomic: a kill or an exception at any point leaves the old or the new
directory (or file) whole, and recover() cleans up what an interrupted commit left."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ftrain.io import atomic

OLD = {"a.txt": b"old a", "b.bin": bytes(range(256)) * 8}
NEW = {"a.txt": b"new a", "c.bin": b"\x00" * 5000, "sub/d.txt": b"nested"}


def contents(folder):
    """{relative path: bytes} of every file under ``folder``: the reference a commit is checked
    against, read with nothing but os.walk."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, folder).replace(os.sep, "/")] = open(full, "rb").read()
    return out


def fill(folder, files):
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)


def make_old(path):
    path.mkdir()
    fill(path, OLD)


# --- write_dir -----------------------------------------------------------------------------------


@pytest.mark.parametrize("existed", [False, True], ids=["fresh", "replace"])
def test_write_dir_commits_the_new_directory_and_leaves_nothing_else(tmp_path, existed):
    path = tmp_path / "ck"
    if existed:
        make_old(path)
    with atomic.write_dir(path) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith("ck.tmp-") and not any(tmp.iterdir())
        fill(tmp, NEW)
        assert contents(path) == (OLD if existed else {})  # nothing visible before the commit
    assert contents(path) == NEW
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


@pytest.mark.parametrize("existed", [False, True], ids=["fresh", "replace"])
def test_an_exception_in_the_block_leaves_the_target_untouched(tmp_path, existed):
    path = tmp_path / "ck"
    if existed:
        make_old(path)
    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic.write_dir(path) as tmp:
            fill(tmp, NEW)
            raise RuntimeError("writer failed")
    assert [p.name for p in tmp_path.iterdir()] == (["ck"] if existed else [])
    if existed:
        assert contents(path) == OLD


class Killed(BaseException):
    """The process died here: not an Exception, so no `except Exception` cleanup swallows it."""


def kill_at(monkeypatch, point, calls):
    """Make the ``point``-th call (counting from 1) of os.replace, os.fsync or shutil.rmtree, and
    every later one, raise Killed: nothing from that point on reaches the disk, as if the process
    had died there. Every call is appended to ``calls``."""
    real = {"replace": os.replace, "fsync": os.fsync, "rmtree": shutil.rmtree}

    def make(name, module):
        def fake(*args, **kwargs):
            calls.append(name)
            if len(calls) >= point:
                raise Killed(name)
            return real[name](*args, **kwargs)

        monkeypatch.setattr(module, name, fake)

    make("replace", os)
    make("fsync", os)
    make("rmtree", shutil)


def commit_killed_at(tmp_path, point, existed):
    """Commit NEW over OLD (or over nothing), killed at ``point``. Returns the calls made."""
    path = tmp_path / "ck"
    if existed:
        make_old(path)
    calls = []
    with pytest.MonkeyPatch.context() as m:
        kill_at(m, point, calls)
        try:
            with atomic.write_dir(path) as tmp:
                fill(tmp, NEW)
        except Killed:
            pass
    return calls


@pytest.mark.parametrize("existed", [False, True], ids=["fresh", "replace"])
def test_a_kill_at_each_point_leaves_the_old_or_the_new_directory_whole(tmp_path, existed):
    (tmp_path / "clean").mkdir()
    calls = commit_killed_at(tmp_path / "clean", 10**9, existed)  # never killed
    # fsync the 3 files and 2 directories, then rename (the old version aside first), then delete
    # the old version: the data is on disk before any rename makes it visible.
    rename = ["replace", "fsync", "replace", "fsync", "rmtree"] if existed else ["replace", "fsync"]
    assert calls == ["fsync"] * 5 + rename
    total = len(calls)
    seen = []
    for point in range(1, total + 2):  # the last point is after the commit finished
        root = tmp_path / f"kill-{point}"
        root.mkdir()
        path = root / "ck"
        commit_killed_at(root, point, existed)
        # What a reader finds right after the kill: the old or the new version, whole, under the
        # name, or (between the two renames) the old one aside.
        if path.exists():
            found = contents(path)
        else:
            old = atomic.leftovers(path)["old"]
            found = contents(old[0]) if old else None
        assert found in (OLD if existed else None, NEW), point
        atomic.recover(path)
        after = contents(path) if path.exists() else None
        assert after == found, point  # recovery keeps what a reader saw
        assert [p.name for p in root.iterdir()] == (["ck"] if path.exists() else []), point
        seen.append("new" if after == NEW else "old")
    # The switch happens once, at the rename of the new version into place.
    switch = seen.index("new")
    assert 0 < switch < total and seen == ["old"] * switch + ["new"] * (len(seen) - switch)


def test_recover_puts_the_newest_old_version_back_and_deletes_the_rest(tmp_path):
    path = tmp_path / "ck"
    for name, files, age in [
        ("ck.old-0000aaaa", {"v": b"older"}, 100),
        ("ck.old-0000bbbb", {"v": b"newest old"}, 10),
        ("ck.tmp-0000cccc", {"v": b"partial"}, 0),
        ("ck.del-0000dddd", {"v": b"doomed"}, 0),
        ("other.tmp-0000eeee", {"v": b"not ours"}, 0),
    ]:
        (tmp_path / name).mkdir()
        fill(tmp_path / name, files)
        stamp = time.time() - age
        os.utime(tmp_path / name, (stamp, stamp))
    (tmp_path / "ck.tmp-nothex").mkdir()  # not a leftover name
    found = atomic.leftovers(path)
    assert [p.name for p in found["old"]] == ["ck.old-0000bbbb", "ck.old-0000aaaa"]
    assert [p.name for p in found["tmp"]] == ["ck.tmp-0000cccc"]
    assert [p.name for p in found["del"]] == ["ck.del-0000dddd"]
    assert [(lo.path.name, lo.target, lo.kind) for lo in atomic.find_leftovers(tmp_path)] == [
        ("ck.del-0000dddd", "ck", "del"),
        ("ck.old-0000aaaa", "ck", "old"),
        ("ck.old-0000bbbb", "ck", "old"),
        ("ck.tmp-0000cccc", "ck", "tmp"),
        ("other.tmp-0000eeee", "other", "tmp"),
    ]
    atomic.recover(path)
    assert contents(path) == {"v": b"newest old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ck",
        "ck.tmp-nothex",
        "other.tmp-0000eeee",
    ]
    atomic.recover(path)  # idempotent
    assert contents(path) == {"v": b"newest old"}


def test_recover_keeps_an_existing_target_and_never_restores_a_deleted_one(tmp_path):
    path = tmp_path / "ck"
    make_old(path)
    (tmp_path / "ck.old-00000001").mkdir()
    atomic.recover(path)
    assert contents(path) == OLD and [p.name for p in tmp_path.iterdir()] == ["ck"]
    gone = tmp_path / "gone"
    (tmp_path / "gone.del-00000002").mkdir()
    atomic.recover(gone)
    assert not any(tmp_path.glob("gone*"))


def test_write_dir_recovers_leftovers_of_an_earlier_commit_first(tmp_path):
    path = tmp_path / "ck"
    (tmp_path / "ck.tmp-00000001").mkdir()
    (tmp_path / "ck.old-00000002").mkdir()
    fill(tmp_path / "ck.old-00000002", OLD)
    with atomic.write_dir(path) as tmp:
        assert contents(path) == OLD  # the interrupted commit's old version is back in place
        fill(tmp, NEW)
    assert contents(path) == NEW and [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_delete_dir_never_leaves_a_partial_directory_under_the_name(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    make_old(path)
    atomic.delete_dir(path)
    assert not any(tmp_path.iterdir())
    make_old(path)
    with monkeypatch.context() as m:
        kill_at(m, 1, calls := [])
        m.setattr(os, "replace", os.rename)  # let the rename through, die at the first fsync
        with pytest.raises(Killed):
            atomic.delete_dir(path)
    assert calls == ["fsync"] and not path.exists()
    assert [lo.kind for lo in atomic.find_leftovers(tmp_path)] == ["del"]
    atomic.recover(path)
    assert not any(tmp_path.iterdir())


# --- a real kill -9 ------------------------------------------------------------------------------

# Loads atomic.py on its own (it needs only the standard library) and commits a directory of 8
# files again and again, each holding the commit's number, printing the number after each commit.
CHILD = textwrap.dedent(
    """
    import importlib.util, pathlib, sys
    spec = importlib.util.spec_from_file_location("atomic", sys.argv[1])
    atomic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(atomic)
    target, n = pathlib.Path(sys.argv[2]), int(sys.argv[3])
    while True:
        n += 1
        with atomic.write_dir(target) as tmp:
            for i in range(8):
                (tmp / f"part{i}").write_bytes(str(n).encode().rjust(8) * 8192)
        print(n, flush=True)
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_kill_9_at_random_moments_leaves_a_whole_directory(tmp_path):
    target = tmp_path / "ck"
    rng = random.Random(0)
    committed = 0
    for _ in range(8):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, atomic.__file__, str(target), str(committed)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            first = child.stdout.readline()
            assert first.strip().isdigit(), first
            time.sleep(rng.uniform(0.0, 0.05))
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            rest = child.stdout.read().split()
            child.wait()
        printed = int(rest[-1]) if rest else int(first)
        # A reader now finds a whole version under the name, or the old one aside.
        seen = contents(target if target.exists() else atomic.leftovers(target)["old"][0])
        atomic.recover(target)
        assert [p.name for p in tmp_path.iterdir()] == ["ck"]
        files = contents(target)
        assert files == seen
        numbers = {data[:8] for data in files.values()}
        assert sorted(files) == [f"part{i}" for i in range(8)] and len(numbers) == 1
        n = int(numbers.pop())
        assert all(data == str(n).encode().rjust(8) * 8192 for data in files.values())
        assert n in (printed, printed + 1)  # the last commit printed, or one not yet printed
        committed = n


# --- single files --------------------------------------------------------------------------------


def test_write_file_replaces_the_file_whole_or_not_at_all(tmp_path):
    path = tmp_path / "f.bin"
    with atomic.write_file(path) as f:
        f.write(b"first")
    assert path.read_bytes() == b"first"
    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic.write_file(path) as f:
            f.write(b"second, half written")
            raise RuntimeError("writer failed")
    assert path.read_bytes() == b"first" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]
    with atomic.write_file(path, "w") as f:
        f.write("é")
    assert path.read_bytes() == "é".encode()
    with pytest.raises(ValueError, match="mode must be 'wb' or 'w'"):
        with atomic.write_file(path, "a"):
            pass


def test_write_json_is_strict_and_atomic(tmp_path):
    path = tmp_path / "meta.json"
    atomic.write_json(path, {"n": 1, "names": ["a", "é"]})
    assert json.loads(path.read_text()) == {"n": 1, "names": ["a", "é"]}
    with pytest.raises(ValueError):
        atomic.write_json(path, {"n": float("nan")})
    assert json.loads(path.read_text())["n"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]
