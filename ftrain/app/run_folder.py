"""The run folder of ``ftrain train``: where a run writes, and what it leaves there.

    ftrain train --out runs/a            # a fresh run: refused if runs/a holds checkpoints
    ftrain train --out runs/a --resume   # the same folder, continued
    ls runs/a        # config.json  metrics.jsonl  loss.png  sample.txt  checkpoint-*

``config.json`` is the settings the run trained with (resolved: under torchrun, the shard strategy
and micro-batches it used); ``metrics.jsonl`` one JSON object per logged step, read as one run after
any number of resumes; ``loss.png`` the loss curve. The checkpoints are written by
``ft.save_checkpoint`` and carry the same settings, which :func:`saved_config` reads back.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ftrain.app.config import TrainConfig
from ftrain.app.run_settings import (
    saved_config,  # re-exported: loop, resume and recipes read it here
)

__all__ = [
    "MetricsLog",
    "check_out",
    "plot_losses",
    "prepare_out",
    "saved_config",
    "write_config",
]


def check_out(cfg: TrainConfig) -> None:
    """A fresh run (no ``--resume``) refuses an ``--out`` that already holds checkpoints.

    Otherwise the two runs would mix: pruning, ``latest_checkpoint`` and a later ``--resume``
    would pick the old run's checkpoints. Raises ValueError (the command: a usage error).
    """
    if cfg.resume or cfg.out is None:
        return
    out = Path(cfg.out)
    old = sorted(p.name for p in out.glob("checkpoint-*")) if out.is_dir() else []
    if old:
        raise ValueError(
            f"--out {out} already holds checkpoints of another run ({', '.join(old[:3])}"
            f"{', ...' if len(old) > 3 else ''}); pass --resume to continue that run, or choose "
            "another --out for a fresh one"
        )


def prepare_out(cfg: TrainConfig) -> Path:
    """The run folder (``--out``, default ``runs/<date-time>``), checked with :func:`check_out`,
    created and proven writable before any work starts; SystemExit with the reason if it is not."""
    check_out(cfg)
    out = Path(cfg.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise SystemExit(f"ftrain train: cannot write to --out {out}: {e.strerror or e}") from None
    return out


def write_config(out: Path, cfg: TrainConfig) -> None:
    """``out/config.json``: every setting of ``cfg`` (``TrainConfig.to_dict``), indented."""
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, each with its ``"step"``.

    A fresh run (``resumed_step`` 0) starts an empty log; a resumed one keeps the lines up to its
    step and drops later ones (written by a run that died before its next checkpoint), so the log
    reads as one run.
    """

    def __init__(self, path: Path, resumed_step: int):
        self.path = path
        if resumed_step and path.exists():
            keep = [ln for ln in path.read_text().splitlines() if _line_step(ln) <= resumed_step]
            path.write_text("".join(ln + "\n" for ln in keep))
        elif path.exists():
            path.unlink()

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line (opened and closed each time: a kill loses no line)."""
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """The sink interface (``ftrain.app.sinks.Sink``): ``{"step": step, **scalars}`` as a
        line."""
        self.write({"step": step, **scalars})

    def close(self) -> None:
        """Nothing to release: each line is written and closed at once."""

    def records(self) -> list[dict[str, Any]]:
        """Every record, in the order written."""
        if not self.path.exists():
            return []
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 0


def plot_losses(records: list[dict[str, Any]], path: Path, *, unit: str = "byte") -> None:
    """A loss-curve PNG at ``path``: train loss per logged step, validation loss where measured,
    in nats per ``unit`` (``"byte"`` for the byte-level GPT, ``"token"`` for a tokenizer's)."""
    # A Figure of its own, not pyplot: no process-wide backend or figure registry is touched.
    # Imported here: only the end of a run draws.
    from matplotlib.figure import Figure

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    valid = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), label="train")
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (nats per {unit})")
    ax.set_title("ftrain train")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
