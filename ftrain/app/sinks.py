"""Where ``ftrain train`` sends its numbers: metric sinks.

A sink is any object with two methods (:class:`Sink`): ``log(step, scalars)`` receives a dict of
plain floats at each log step (``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ... and, after
an evaluation, ``val_loss`` and ``val_perplexity``), ``close()`` is called once at the end of a
run. ``metrics.jsonl`` is always written (``ftrain.app.run_folder.MetricsLog`` is the built-in
sink); ``--log tensorboard`` adds :class:`TensorBoardSink`. Your own, e.g. Weights & Biases::

    class WandbSink:
        def __init__(self, **init):
            import wandb
            self.run = wandb.init(**init)
        def log(self, step, scalars):
            self.run.log(scalars, step=step)
        def close(self):
            self.run.finish()

    ftrain.app.loop.train(TrainConfig(...), sinks=[WandbSink(project="mine")])

or MLflow: ``mlflow.log_metrics(scalars, step=step)`` in ``log``, ``mlflow.end_run()`` in
``close``. Sinks run on the main process only, between steps (never inside the step).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = ["Sink", "TensorBoardSink", "SINKS", "check_sink", "make_sinks"]

# The names --log accepts: metrics.jsonl alone, or with TensorBoard event files beside it.
SINKS = ("jsonl", "tensorboard")


@runtime_checkable
class Sink(Protocol):
    """What receives a run's scalars: ``log`` at each log step, ``close`` once at the end."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record ``scalars`` (name -> plain float) at optimizer step ``step``."""
        ...

    def close(self) -> None:
        """Flush and release what the sink holds; no ``log`` follows."""
        ...


class TensorBoardSink:
    """TensorBoard event files in ``log_dir`` (``torch.utils.tensorboard.SummaryWriter``): one
    scalar series per name, tagged ``train/<name>`` (``val/<name>`` for names starting with
    ``val_``). Needs the ``tensorboard`` package (``pip install 'ftrain[tensorboard]'``); view
    with ``tensorboard --logdir runs/``."""

    def __init__(self, log_dir: str | Path, *, purge_step: int | None = None):
        SummaryWriter = _summary_writer()
        # purge_step: a resumed run hides what a previous run logged after its checkpoint
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            if name == "step":
                continue
            tag = f"val/{name[4:]}" if name.startswith("val_") else f"train/{name}"
            self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


def check_sink(name: str) -> None:
    """Raise now what :func:`make_sinks` would raise for ``--log name`` (an unknown name, a
    missing package), so a run refuses it before it builds anything."""
    if name not in SINKS:
        raise ValueError(f"--log must be one of {SINKS}, got {name!r}")
    if name == "tensorboard":
        _summary_writer()


def make_sinks(name: str, out: Path, start: int = 0) -> list[Sink]:
    """The sinks ``--log name`` adds to ``metrics.jsonl`` for the run folder ``out`` of a run
    starting at step ``start``: ``"jsonl"`` none, ``"tensorboard"`` a :class:`TensorBoardSink`
    in ``out/tensorboard``."""
    check_sink(name)
    if name == "tensorboard":
        return [TensorBoardSink(Path(out) / "tensorboard", purge_step=start + 1 if start else None)]
    return []


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch raises this when the tensorboard package is missing
        raise ImportError(
            "--log tensorboard needs the tensorboard package: pip install "
            "'ftrain[tensorboard]' (or pip install tensorboard)"
        ) from e
    return SummaryWriter
