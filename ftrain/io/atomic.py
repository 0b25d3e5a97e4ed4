"""Atomic commits: a reader of a path finds the old version or the new one, whole, never a mix.

A directory is committed by :func:`write_dir`: it is written into a temporary sibling, every file
and the directory are fsynced, and it is renamed into place; an existing target is renamed aside
first and deleted last. A rename within one directory is atomic and the fsyncs put the data on disk
before it, so a process killed (or a machine losing power) at any moment leaves the old directory
or the new one whole under the target's name, or, between the two renames, no directory there and
the old one aside. :func:`recover` puts that back and deletes the rest. What an interrupted commit
leaves beside ``<name>``:

    <name>.tmp-<hex>   a new version being written (never complete: deleted by recover)
    <name>.old-<hex>   the previous version, renamed aside (put back if <name> is missing)
    <name>.del-<hex>   a directory being deleted by delete_dir (deleted by recover)

A single file is committed by :func:`write_file` (or :func:`write_json`) through a hidden
temporary sibling and one rename. Nothing here locks: one process writes a given path at a time.
Only the standard library is used, so that this module stands on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

__all__ = [
    "Leftover",
    "commit_dir",
    "delete_dir",
    "find_leftovers",
    "fsync_dir",
    "fsync_file",
    "leftovers",
    "recover",
    "temporary_dir",
    "write_dir",
    "write_file",
    "write_json",
]

_KINDS = ("tmp", "old", "del")
_LEFTOVER = re.compile(r"(?P<target>.+)\.(?P<kind>tmp|old|del)-[0-9a-f]+")


class Leftover(NamedTuple):
    """A directory that an interrupted :func:`write_dir` or :func:`delete_dir` left behind."""

    path: Path  # the leftover itself, e.g. runs/a/checkpoint-10.old-1a2b3c4d
    target: str  # the name of the directory it belongs to, e.g. "checkpoint-10"
    kind: str  # "tmp" (being written), "old" (renamed aside) or "del" (being deleted)


# --- fsync ---------------------------------------------------------------------------------------


def fsync_file(path: str | os.PathLike) -> None:
    """Block until the contents of the file ``path`` are on disk."""
    with open(path, "r+b") as f:  # opened for writing: Windows refuses to flush a read-only fd
        os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (new files, renames) durable. A no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory, deepest first."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(os.path.join(folder, name))
        fsync_dir(folder)


# --- directories ---------------------------------------------------------------------------------


@contextlib.contextmanager
def write_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Write a directory and commit it as ``path`` atomically: yields an empty temporary sibling.

    Fill the yielded directory; when the ``with`` block ends without an exception every file in it
    and the directory are fsynced and it is renamed to ``path``. An existing ``path`` (a directory)
    is renamed aside first and deleted after the new one is in place. If the block raises, the
    temporary directory is deleted and ``path`` is untouched. Whenever the process dies,
    ``path`` holds the old version or the new one whole, or is missing while the old version waits
    aside: :func:`recover` puts it back. Leftovers of earlier commits of ``path`` are recovered
    before writing. ``path``'s parent must exist. Example::

        with atomic.write_dir("out/report") as tmp:
            (tmp / "a.txt").write_text("...")
            (tmp / "b.txt").write_text("...")
    """
    tmp = temporary_dir(path)
    try:
        yield tmp
        _fsync_tree(tmp)
        commit_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already if the commit got that far
        raise


def temporary_dir(path: str | os.PathLike) -> Path:
    """A new empty ``<path>.tmp-<hex>`` directory to write a new version of ``path`` into, after
    recovering what earlier interrupted commits of ``path`` left (:func:`recover`).

    For writers that fill it from several processes (a sharded checkpoint): fill it, fsync what
    was written, then :func:`commit_dir` it from one process. A kill before the commit leaves only
    the ``.tmp-`` leftover, which readers ignore and :func:`recover` deletes.
    """
    path = Path(path)
    recover(path)
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    tmp.mkdir()
    return tmp


def commit_dir(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename the finished, fsynced directory ``tmp`` to ``path`` atomically; an existing
    ``path`` is renamed aside first and deleted last (a kill leaves the old or the new one whole,
    or the old one aside for :func:`recover`)."""
    tmp, path = Path(tmp), Path(path)
    if not path.exists():
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return
    aside = path.with_name(f"{path.name}.old-{secrets.token_hex(4)}")
    os.replace(path, aside)
    fsync_dir(path.parent)
    try:
        os.replace(tmp, path)
    except BaseException:
        # Put the old version back; if even that fails, recover() finds it aside.
        with contextlib.suppress(Exception):
            os.replace(aside, path)
        raise
    fsync_dir(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


def delete_dir(path: str | os.PathLike) -> None:
    """Delete the directory ``path`` so that no partial directory is ever left under its name.

    It is renamed to ``<path>.del-<hex>`` first, then deleted; a kill mid-delete leaves only that
    leftover, which :func:`recover` deletes.
    """
    path = Path(path)
    doomed = path.with_name(f"{path.name}.del-{secrets.token_hex(4)}")
    os.replace(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def find_leftovers(folder: str | os.PathLike) -> list[Leftover]:
    """Every leftover directory of an interrupted commit or delete in ``folder``, by name."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        m = _LEFTOVER.fullmatch(entry.name)
        if m and entry.is_dir():
            found.append(Leftover(entry, m["target"], m["kind"]))
    return sorted(found, key=lambda lo: lo.path.name)


def leftovers(path: str | os.PathLike) -> dict[str, list[Path]]:
    """What interrupted commits or deletes of ``path`` left beside it: ``{"tmp": [...],
    "old": [...], "del": [...]}``, each list newest first (by modification time).

    A reader that finds ``path`` missing may read ``leftovers(path)["old"][0]``: the previous
    version, whole, that a commit killed between its two renames left aside.
    """
    path = Path(path)
    found: dict[str, list[Path]] = {kind: [] for kind in _KINDS}
    for lo in find_leftovers(path.parent):
        if lo.target == path.name:
            found[lo.kind].append(lo.path)
    for paths in found.values():
        paths.sort(key=_mtime, reverse=True)
    return found


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def recover(path: str | os.PathLike) -> None:
    """Undo what interrupted commits or deletes of ``path`` left: if ``path`` is missing and an
    old version waits aside, rename it back (the newest); delete every other leftover.

    Afterwards ``path`` is what it was before the interrupted commit, or what it committed, and
    no leftover of ``path`` remains. Safe to call at any time, as long as no other process is
    writing ``path``.
    """
    path = Path(path)
    found = leftovers(path)
    if not path.exists() and found["old"]:
        os.replace(found["old"].pop(0), path)
        fsync_dir(path.parent)
    for leftover in found["tmp"] + found["old"] + found["del"]:
        shutil.rmtree(leftover, ignore_errors=True)


# --- single files --------------------------------------------------------------------------------


@contextlib.contextmanager
def write_file(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Write the file ``path`` atomically: yields a file open on a hidden temporary sibling.

    When the ``with`` block ends without an exception the file is flushed, fsynced and renamed to
    ``path`` (replacing it), then the directory is fsynced: readers see the old contents or the
    new ones, whole. If the block raises, the temporary file is deleted and ``path`` is untouched.
    A kill can leave the hidden ``.<name>.tmp-<hex>`` file behind; it is never read as ``path``.

    Args:
        path: the file to write; its parent must exist.
        mode: ``"wb"`` (bytes, the default) or ``"w"`` (text, UTF-8).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic.write_file(mode=...): mode must be 'wb' or 'w', got {mode!r}.")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1) -> None:
    """Write ``obj`` as strict JSON (no NaN or infinity) to ``path`` atomically (:func:`write_file`)."""
    with write_file(path, "w") as f:
        json.dump(obj, f, indent=indent, allow_nan=False)
