"""Reading a settings file: TOML, or JSON such as a run's ``config.json``, checked key by key.

    raw, is_json = read_settings("train.toml", {"lr": float, "out": str | None})

Generic over the settings' type hints (``ftrain.app.config.load_settings`` passes
``TrainConfig``'s), so that every way a file can be wrong is one ``ValueError`` line starting with
``--config PATH:``, which ``ftrain train`` reports as its usage error.
"""

from __future__ import annotations

import json
import sys
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["check_settings", "read_settings"]


def read_settings(
    path: str | Path, hints: Mapping[str, Any], *, skip: Iterable[str] = ()
) -> tuple[dict[str, Any], bool]:
    """The settings in the file ``path`` (keys as in ``hints``, dashes allowed), and whether it
    was JSON (the ``.json`` suffix, or ``{`` as its first character; else TOML). Keys in
    ``skip`` are dropped from a JSON file (a run's record of things that are not settings).

    **Invariant:** the result has only keys of ``hints``, each value of its hinted type (an int
    is also a float; a bool is only a bool; None only where the hint allows it); anything else
    (no such file, unreadable, not TOML / JSON, not a table of settings, an unknown key, a value
    of the wrong type) is a ``ValueError`` of one line that starts with ``--config PATH:``.
    """
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except OSError as e:  # a folder, no permission, ...
        raise ValueError(f"--config {path}: cannot read it: {e.strerror or e}") from None
    is_json = Path(path).suffix == ".json" or text.lstrip().startswith(b"{")
    kind = "JSON" if is_json else "TOML"
    try:
        raw = json.loads(text) if is_json else tomllib.loads(text.decode())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, TOMLDecodeError
        raise ValueError(f"--config {path}: not valid {kind}: {e}".splitlines()[0]) from None
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: a {kind} table of settings expected, got {raw!r:.40}")
    skip = set(skip) if is_json else set()
    raw = {k: v for k, v in raw.items() if k.replace("-", "_") not in skip}
    out = check_settings(raw, hints, f"--config {path}")
    return out, is_json


def check_settings(raw: Mapping[str, Any], hints: Mapping[str, Any], source: str) -> dict:
    """``raw``'s settings (dashes in keys read as underscores), each checked against ``hints``
    as :func:`read_settings` checks a file's; errors start with ``source:``."""
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in hints:
            raise ValueError(
                f"{source}: unknown setting {key!r} (from another ftrain version, or a typo?); "
                f"known: {', '.join(sorted(hints))}"
            )
        out[name] = _check_type(source, key, value, hints[name])
    return out


def _check_type(source, key: str, value: Any, hint) -> Any:
    """``value`` if it fits the type ``hint`` (``int``, or ``int | None``), else a ValueError
    naming the key, the value and the type expected."""
    options = [a for a in typing.get_args(hint) if a is not type(None)]
    typ = options[0] if options else hint
    if value is None and type(None) in typing.get_args(hint):
        return None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, typ) and (typ is bool or not isinstance(value, bool)):
        return value
    how = ' (a string is "quoted")' if typ is str else ""
    if typ is bool:
        how = " (true or false, unquoted)"
    raise ValueError(
        f"{source}: {key} must be {_a(typ.__name__)}{how}, got {key} = {value!r} "
        f"({_a(type(value).__name__)})"
    )


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"
