"""How the processes of one launch split the model (``--tp``, ``--pp``), the checks of those
flags, and the sizes the loop derives from them.

Ranks are laid out ``dp x pp x tp`` (``ft.distributed.pipeline.pp_mesh``; ``dp x tp`` without
``--pp``): the ``tp * pp`` processes of a data-parallel group see the same rows.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "model_parallel",
    "data_parallel",
    "check_tp",
    "check_pp",
    "pp_microbatches",
    "build_mesh",
    "build_pipeline",
    "build_tensor_parallel",
    "pipeline_of",
    "lay_out",
    "whole_state",
]


def model_parallel(cfg: Any) -> int:
    """How many processes share one copy of the rows (tensor x pipeline parallel)."""
    return cfg.tp * cfg.pp


def data_parallel(cfg: Any, world: int) -> int:
    """How many groups of processes split the batch."""
    return world // model_parallel(cfg)


def _int_at_least_one(flag: str, value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--{flag} must be an int >= 1 (1 = no {what}), got {value!r}")


def check_tp(cfg: Any) -> None:
    """``--tp``'s value and what it does not combine with."""
    _int_at_least_one("tp", cfg.tp, "tensor parallelism")
    if cfg.tp == 1:
        return
    refused = {
        "compile": cfg.compile,
        "lora-rank": bool(cfg.lora_rank),
        "memory-budget": cfg.memory_budget is not None,
        "optimizer adamw8bit": cfg.optimizer == "adamw8bit",  # codes of whole tensors
    }
    for flag, bad in refused.items():
        if bad:
            raise ValueError(
                f"--tp {cfg.tp} cannot be combined with --{flag} (tensor parallelism "
                "composes with --shard ddp/zero1/zero2/fsdp over the data-parallel groups, "
                f"accumulation, checkpointing and precision); use --tp {cfg.tp} without "
                f"--{flag}"
            )


def pp_microbatches(cfg: Any) -> int:
    """``--pp-microbatches``, or its default: twice the stages (``ft.pipeline``'s)."""
    if cfg.pp_microbatches is not None:
        return cfg.pp_microbatches
    from ftrain.distributed.pipeline.runner import SINGLE_STAGE

    per_rank = 1 if cfg.pp_schedule in SINGLE_STAGE else 2
    return 2 * cfg.pp * per_rank


def check_pp(cfg: Any) -> None:
    """``--pp`` and its schedule and micro-batches: their values, what they do not combine
    with, and a batch the micro-batches divide (the stages exchange fixed shapes)."""
    _int_at_least_one("pp", cfg.pp, "pipeline parallelism")
    if cfg.pp == 1:
        return
    refused = {
        "sequence-parallel": cfg.sequence_parallel,  # its engine and the pipeline's are two
        "compile": cfg.compile,
        "lora-rank": bool(cfg.lora_rank),
        "memory-budget": cfg.memory_budget is not None,
        "offload": cfg.offload != "none",
        "pack": cfg.pack,
        "n-experts": bool(cfg.n_experts),
    }
    for flag, bad in refused.items():
        if bad:
            raise ValueError(
                f"--pp {cfg.pp} cannot be combined with --{flag} (pipeline parallelism composes "
                "with --tp, any --shard over the data-parallel groups, accumulation, checkpointing "
                f"and precision); use --pp {cfg.pp} without --{flag}"
            )
    if cfg.pp_microbatches is not None:
        _int_at_least_one("pp-microbatches", cfg.pp_microbatches, "micro-batching")
    m = pp_microbatches(cfg)
    if m < cfg.pp:
        raise ValueError(
            f"--pp-microbatches {m} is fewer than the --pp {cfg.pp} stages: some would idle the "
            f"whole step; give at least {cfg.pp} (e.g. {2 * cfg.pp})"
        )
    if cfg.batch_size % m:
        raise ValueError(
            f"--batch-size {cfg.batch_size} must be a multiple of --pp-microbatches {m} (each "
            "stage passes micro-batches of one shape on); e.g. --batch-size "
            f"{m * max(1, cfg.batch_size // m)}"
        )


def build_mesh(cfg: Any):
    """The process mesh of ``--tp`` (``("dp", "tp")``) or ``--pp`` (``("dp", "pp", "tp")``), or
    None without either. A collective."""
    import ftrain as ft

    if cfg.pp > 1:
        return ft.distributed.pipeline.pp_mesh(cfg.pp, cfg.tp)
    return ft.distributed.tp_mesh(cfg.tp) if cfg.tp > 1 else None


def build_pipeline(cfg: Any, model: Any, mesh: Any):
    """The ``ft.pipeline`` transform of ``--pp`` for ``model`` (the built-in GPT or a Hugging
    Face GPT-2 / Llama) on ``mesh``: blocks cut evenly, ``--pp-schedule``,
    ``--pp-microbatches``."""
    import ftrain as ft

    return ft.pipeline(model, mesh, schedule=cfg.pp_schedule, microbatches=pp_microbatches(cfg))


def build_tensor_parallel(cfg: Any, model: Any, mesh: Any):
    """The ``ft.tensor_parallel`` transform of ``--tp`` for ``model`` on ``mesh`` (``("dp",
    "tp")``): the model's plan (``plan_for``), with ``--sequence-parallel``."""
    import ftrain as ft
    from ftrain.distributed.tensor_parallel.plans import plan_for

    return ft.tensor_parallel(model, plan_for(model), mesh, sequence_parallel=cfg.sequence_parallel)


def pipeline_of(step: Any):
    """The step's ``ft.pipeline`` transform (``--pp``), or None."""
    from ftrain.transforms import Pipeline

    return next((t for t in step.transforms if isinstance(t, Pipeline)), None)


def lay_out(cfg: Any, state: Any, tp: Any, pipe: Any):
    """A whole state as this process holds it: ``tp``'s pieces (``--tp``), then the pipeline's
    stages (``--pp``), then ``--shard``'s layout over the data-parallel groups (under either,
    over their mesh's ``dp``; ddp's there is the plain tensors)."""
    from ftrain.distributed import shard_state

    for split in (tp, pipe):
        if split is not None:
            state = split.shard_state(state)
    split = pipe if pipe is not None else tp
    if split is None:
        return state if cfg.shard == "none" else shard_state(state, cfg.shard)
    if cfg.shard in ("none", "ddp"):
        return state
    return shard_state(state, cfg.shard, mesh=split.mesh["dp"])


def whole_state(pipe: Any, state: Any):
    """The whole state on every process from a pipelined one (a collective: ``--shard``'s pieces
    gathered over dp, then each stage's tensors broadcast by their rank)."""
    from ftrain.distributed import unshard_state

    return pipe.unshard_state(unshard_state(state))
