"""Built-in corpora: real text that is present offline on every machine.

>>> from ftrain.data import corpora, build_token_dataset
>>> files = corpora.python_stdlib()              # doctest: +SKIP
>>> build_token_dataset(files, "data/stdlib")    # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

__all__ = ["python_stdlib"]

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}


def python_stdlib(*, include_tests: bool = False, root: str | Path | None = None) -> list[Path]:
    """The `.py` files of the running interpreter's standard library, as a list of paths.

    Guarantees: every path is a `.py` file under `sysconfig.get_paths()["stdlib"]` (or `root`),
    never under `site-packages`/`dist-packages`; with `include_tests=False` (the default, about
    12 MB on CPython 3.11) the test packages (`test/`, `tests/`, `idle_test/`) and `test_*.py`
    files are left out. The order is fixed for a given library, and it is *not* alphabetical:
    files are ordered by a hash of their relative path, so that a contiguous range of documents
    (how `TokenDataset` cuts train/valid/test splits) samples the whole library rather than
    one package.

    Files are returned as paths, not read: `build_token_dataset` reads them, and skips and counts
    the ones that are not valid UTF-8 (the stdlib's test suite holds a few on purpose).

    Args:
        include_tests: also return the test suite (about 31 MB in all on CPython 3.11).
        root: a different library root (for tests); default: this interpreter's stdlib.
    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(
            f"python_stdlib: the standard library folder {str(base)!r} does not exist; "
            "pass root=<folder of .py files>"
        )
    files = []
    for path in base.rglob("*.py"):
        parts = path.relative_to(base).parts
        if _SKIP_DIRS.intersection(parts[:-1]):
            continue
        if not include_tests and (
            _TEST_DIRS.intersection(parts[:-1]) or parts[-1].startswith("test_")
        ):
            continue
        if path.is_file():
            files.append(path)

    def key(path: Path) -> str:
        rel = path.relative_to(base).as_posix()
        return hashlib.sha1(rel.encode()).hexdigest()

    return sorted(files, key=key)
