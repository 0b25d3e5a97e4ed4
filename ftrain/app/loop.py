"""The training loop of ``ftrain train``: steps, evaluation, Ctrl-C, resume and checkpoints.

    ftrain train --max-steps 600 --out runs/a      # Ctrl-C saves a checkpoint and exits (130)
    ftrain train --out runs/a --resume             # continue from the newest valid checkpoint
    torchrun --nproc_per_node 2 -m ftrain train --shard ddp

    from ftrain.app.config import TrainConfig
    from ftrain.app.loop import train
    summary = train(TrainConfig(max_steps=100, out="runs/a"))   # {"step", "loss", "seconds", ...}

:func:`train` reads top to bottom: resolve the settings, open the run folder, build the recipe
(``ftrain.app.recipes.gpt``), restore a checkpoint, run the steps, save, report. Everything a
resumed run needs (params, optimizer state, step, RNG key, loss scale, data position) is in the
checkpoint, so a run stopped and resumed gives the same result, bit for bit on a CPU, as one that
never stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

import ftrain as ft
from ftrain import distributed
from ftrain.app import resume, run_folder
from ftrain.app.config import TrainConfig
from ftrain.app.model_parallel import (
    data_parallel,
    lay_out,
    model_parallel,
    pipeline_of,
    whole_state,
)
from ftrain.app.recipes import finetune, for_config, gpt, placement
from ftrain.app.resume import RESUME_FIXED
from ftrain.app.sinks import Sink, check_sink, make_sinks

# The one import of the sharding helpers (the recipe composes the step with the public ft.shard).
from ftrain.distributed import unshard, unshard_state
from ftrain.distributed.dtensor import is_dtensor
from ftrain.distributed.launch import backend_for, group_device, runs_nccl
from ftrain.io.sharded import is_sharded
from ftrain.transforms import Pipeline, TensorParallel
from ftrain.transforms.lora import join_base, split_base

__all__ = ["RESUME_FIXED", "validation_loss", "train"]  # RESUME_FIXED lives in ftrain.app.resume


def train(cfg: TrainConfig, *, sinks: Sequence[Sink] = ()) -> dict[str, Any]:
    """Train as ``cfg`` says; returns a summary (``step``, ``seconds``, ``out``, the last logged
    metrics, ``val_loss``, ``val_perplexity``, and ``interrupted`` after a Ctrl-C).

    Each log step's scalars go to ``metrics.jsonl``, to the sinks ``cfg.log`` names and to
    ``sinks`` (your own ``ftrain.app.sinks.Sink`` objects, e.g. W&B), on the main process only.

    ``cfg`` is not changed. The settings the run resolves (the shard strategy under torchrun,
    ``micro_batches`` from ``global_batch_size``) are a new TrainConfig, which config.json and
    every checkpoint record.
    """
    cfg, rank, world = _launch(cfg)
    # a GPU run's kernels launch on its own GPU (cuda:N), for this call only
    on_gpu = torch.device(cfg.device).type == "cuda"
    with torch.cuda.device(cfg.device) if on_gpu else contextlib.nullcontext():
        return _train(cfg, rank, world, sinks)


def _train(cfg: TrainConfig, rank: int, world: int, sinks: Sequence[Sink]) -> dict[str, Any]:
    """:func:`train` once the settings are resolved and the process group is joined."""
    main = rank == 0
    if main:
        check_sink(cfg.log)  # a missing tensorboard package, before the data and model are built
    if cfg.memory_budget is not None:  # ft.fit chooses the composition before anything is built
        from ftrain.app.recipes.memory_budget import fit_config

        cfg, fitted = fit_config(cfg)
        if main:
            print(fitted, flush=True)
    if main:  # the device, precision and kernels this run picked (config.json records them too)
        print(placement.describe(cfg), flush=True)
    out = Path(_from_rank0(str(run_folder.prepare_out(cfg)) if main else None, world))
    recipe = for_config(cfg).build(cfg, rank=rank, world=world, quiet=not main)
    cfg = recipe.cfg  # resolved: --epochs N is max_steps from here on
    if main:  # the rest of the startup summary: data, rows, epochs, validation, params
        print(recipe.summary, flush=True)
    if main:  # model.json (the model folder, its sha256) and chat_template.jinja
        finetune.record_run(out, cfg)
    pipe = pipeline_of(recipe.step)
    run = _Run(cfg, rank, world, out, recipe, pipe)
    state = recipe.state
    tp = next((t for t in recipe.step.transforms if isinstance(t, TensorParallel)), None)
    born = any(is_dtensor(t) for t in ft.tree.leaves(state.params))  # gpt.born_sharded (LoRA: base)
    if not born:  # whole tensors -> this process's pieces (tp's, the stages, over dp)
        state = lay_out(cfg, state, tp, pipe)
    state, start = _restore(run, state)  # each process reads only what it keeps
    log = run_folder.MetricsLog(out / "metrics.jsonl", start) if main else None
    if main:
        run_folder.write_config(out, cfg)
        sinks = [*make_sinks(cfg.log, out, start), *sinks]
    report = _Report(run, log, start, sinks if main else ())
    # Checkpoints are written in the background while training goes on; leaving waits for the last.
    try:
        with ft.Saver() as saver:
            state, interrupted = _train_steps(run, state, start, report, saver)
            report.close()
            _save(run, state, saver)
            return _finish(run, state, report, interrupted)
    finally:
        report.close_sinks()


@dataclasses.dataclass(frozen=True)
class _Run:
    """What stays fixed while one process trains (the state is passed along, never stored)."""

    cfg: TrainConfig  # resolved by _launch
    rank: int
    world: int
    out: Path  # rank 0's run folder, on every process
    recipe: gpt.Recipe
    pipe: Pipeline | None = None  # --pp's transform: each process holds its stages' state

    @property
    def main(self) -> bool:
        return self.rank == 0


def _launch(cfg: TrainConfig) -> tuple[TrainConfig, int, int]:
    """Join the process group under torchrun; returns the resolved settings, rank and world size.

    The settings are a new TrainConfig (``dataclasses.replace``): under torchrun without
    ``--shard``, ``shard="ddp"`` (plain data parallelism); with ``--global-batch-size``,
    ``micro_batches = global_batch_size / (batch_size x world / tp)``; ``device`` and
    ``precision`` resolved (``placement.resolve``: under torchrun, ``auto`` and ``cuda`` are this
    process's ``LOCAL_RANK`` GPU), and the process group on NCCL for a GPU, gloo for the CPU;
    ``matmul`` resolved on rank 0 (``gpt.resolve_matmul``) and the same on every process (a
    resumed run's is the one it recorded, not timed again).
    """
    if cfg.shard == "none" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        cfg = dataclasses.replace(cfg, shard="ddp")
    if cfg.device == "auto" and distributed.is_initialized():
        # a group made before train() (run_distributed's gloo one) decides: NCCL runs on GPUs
        if not runs_nccl(torch.distributed.get_backend()):
            cfg = dataclasses.replace(cfg, device="cpu")
    try:
        cfg = placement.resolve(cfg)
    except ValueError as e:  # the config was validated on another machine, or not at all
        raise SystemExit(f"ftrain train: error: {e}") from None
    if cfg.shard != "none":
        try:
            distributed.init(backend_for(cfg.device, host_collectives=cfg.offload != "none"))
        except RuntimeError as e:
            raise SystemExit(f"ftrain train: --shard {cfg.shard}: {e}") from None
    rank, world = distributed.rank_and_world()
    split = model_parallel(cfg)
    if world % split:
        flags = " x ".join(f"--{k} {v}" for k, v in (("tp", cfg.tp), ("pp", cfg.pp)) if v > 1)
        raise SystemExit(
            f"ftrain train: {flags} = {split} must divide the {world} processes (the mesh is "
            f"data-parallel groups x {split}); launch a multiple of {split} processes "
            f"(torchrun --nproc_per_node N) or choose sizes whose product divides {world}"
        )
    if cfg.global_batch_size is not None:
        # the tp x pp processes of a group share rows
        per_step = cfg.batch_size * data_parallel(cfg, world)
        if cfg.global_batch_size % per_step:
            raise SystemExit(
                f"ftrain train: --global-batch-size {cfg.global_batch_size} must be a multiple of "
                f"--batch-size x data-parallel processes = {cfg.batch_size} x "
                f"{data_parallel(cfg, world)} = {per_step}"
            )
        cfg = dataclasses.replace(cfg, micro_batches=cfg.global_batch_size // per_step)
    # the matmul kernel: rank 0 times "auto" (on the CPU) and every process builds with its answer
    kernel = _from_rank0(gpt.resolve_matmul(cfg).matmul if rank == 0 else None, world)
    return dataclasses.replace(cfg, matmul=kernel), rank, world


# -- resume -------------------------------------------------------------------------------------
def _restore(run: _Run, state: ft.TrainState) -> tuple[ft.TrainState, int]:
    """``state`` (the recipe's at step 0, laid out for this process), or on ``--resume`` the
    newest valid checkpoint's laid out the same way (after checking that it continues this run),
    with the data position restored; and its step. The checkpoint may come from any number of
    processes, any ``--shard`` strategy and any ``--pp``."""
    cfg = run.cfg
    if not cfg.resume:
        return state, 0
    # Rank 0 finds the newest checkpoint that verifies (reading each file once; what an
    # interrupted save left is warned about, and the next save_checkpoint tidies it); all load it.
    latest = _from_rank0(ft.latest_checkpoint(run.out) if run.main else None, run.world)
    if latest is None:
        if run.main:
            print(f"ftrain train: --resume: no checkpoint in {run.out}; starting from step 0")
        return state, 0
    meta = ft.load_meta(latest)
    like, base = finetune.checkpoint_like(state, meta)  # a LoRA checkpoint holds no frozen base
    dp = data_parallel(cfg, run.world)
    state = resume.load_checked(latest, meta, cfg, like, dp, run.main, pipeline=run.pipe)
    state = join_base(state, base)
    run.recipe.loader.load_state_dict(meta["extra"]["loader"])  # global: the same on every rank
    start = int(state.step)
    if run.main:
        print(f"ftrain train: resumed from {latest} (step {start})")
    return state, start


# -- the steps ----------------------------------------------------------------------------------
def _train_steps(
    run: _Run, state: ft.TrainState, start: int, report: _Report, saver: ft.Saver
) -> tuple[ft.TrainState, bool]:
    """Steps ``start + 1`` to ``max_steps``, logging, evaluating and saving on their schedules;
    returns the state and whether a Ctrl-C stopped it early (always after a whole step)."""
    cfg, recipe = run.cfg, run.recipe
    # Leaving the block stops the loader's threads (its position, saved after, stays).
    with iter(recipe.loader) as batches, _deferred_interrupt() as flag:
        for n in range(start + 1, cfg.max_steps + 1):
            state, metrics = recipe.step(state, next(batches))
            if n % cfg.log_every == 0 or n == cfg.max_steps:
                report.metrics(n, metrics)
            if cfg.eval_every and n % cfg.eval_every == 0 and recipe.valid is not None:
                params = _eval_params(run, state)  # under sharding a collective: every process
                if run.main:
                    report.validation(n, validation_loss(recipe.model, params, recipe.valid, cfg))
            if cfg.save_every and n % cfg.save_every == 0 and n != cfg.max_steps:
                _save(run, state, saver)
            report.advance()
            if run.world > 1:  # stop together: a process that stops alone leaves the others waiting
                flag["stop"] = _any_rank(flag["stop"])
            if flag["stop"]:
                return state, True
    return state, False


class _Report:
    """Where a log step's numbers go: metrics.jsonl and the progress bar (rank 0 only)."""

    def __init__(
        self, run: _Run, log: run_folder.MetricsLog | None, start: int, sinks: Sequence[Sink] = ()
    ):
        cfg = run.cfg
        self.log = log
        self.sinks = list(sinks)  # besides metrics.jsonl
        self.bar = None
        if run.main and cfg.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=cfg.max_steps, initial=start, unit="step", dynamic_ncols=True)
        # under --tp / --pp the processes of a group see the same rows
        self.tokens_per_step = (
            cfg.batch_size * cfg.micro_batches * cfg.seq_len * data_parallel(cfg, run.world)
        )
        self.t0 = self.t_log = time.perf_counter()
        self.step_at_log = start
        self.last: dict[str, float] = {}  # the last log step's metrics (and val_loss after it)

    def metrics(self, n: int, metrics: dict[str, torch.Tensor]) -> None:
        now = time.perf_counter()  # float() below is the host sync of this log step
        self.last = {k: float(v) for k, v in metrics.items()}
        rec = {"step": n, **self.last}
        seconds = max(now - self.t_log, 1e-9)
        rec["tokens_per_s"] = self.tokens_per_step * (n - self.step_at_log) / seconds
        rec["elapsed_s"] = now - self.t0
        self.t_log, self.step_at_log = now, n
        if self.log is not None:
            self.log.write(rec)
        for sink in self.sinks:
            sink.log(n, {k: v for k, v in rec.items() if k != "step"})
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{self.last['loss']:.3f}",
                tok_s=f"{rec['tokens_per_s']:.0f}",
                lr=f"{self.last['lr']:.2e}",
            )

    def validation(self, n: int, val: float) -> None:
        rec = {"val_loss": val, "val_perplexity": math.exp(min(val, 700.0))}  # exp: no overflow
        self.log.write({"step": n, **rec})
        for sink in self.sinks:
            sink.log(n, rec)
        self.last.update(rec)
        if self.bar is not None:
            ppl = rec["val_perplexity"]
            self.bar.write(f"step {n}: validation loss {val:.4f}, perplexity {ppl:.2f}")

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close_sinks(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def _eval_params(run: _Run, state: ft.TrainState):
    """The whole params to evaluate and sample with (``gpt.eval_params``). Every process calls
    it: the params are gathered, and the optimizer state too when the eval params need it."""
    if run.pipe is not None:
        return gpt.eval_params(run.cfg, whole_state(run.pipe, state))
    if run.cfg.optimizer in gpt.SCHEDULE_FREE or run.cfg.lora_rank:  # LoRA: merged
        return gpt.eval_params(run.cfg, unshard_state(state))
    return unshard(state.params)


def validation_loss(model: torch.nn.Module, params, dataset, cfg: TrainConfig) -> float:
    """Mean token loss (``ft.evaluate``: exact, no gradients, eval mode) over the first
    ``eval_batches`` batches of ``dataset``: the same rows every time, so losses of one run
    compare. ``model`` is not changed. It runs where ``params`` are (the batches go there)."""
    device = ft.tree.first_leaf(params).device

    def loss_fn(params, batch):
        packed = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        out = ft.apply(model, params, batch["input"], **packed)
        return ft.losses.cross_entropy(getattr(out, "logits", out), batch["target"])  # HF: .logits

    def batches():
        n = min(len(dataset), cfg.eval_batches * cfg.batch_size)
        for start in range(0, n, cfg.batch_size):
            rows = [dataset[i] for i in range(start, min(start + cfg.batch_size, n))]
            yield {k: torch.stack([r[k] for r in rows]).to(device) for k in rows[0]}

    return ft.evaluate(loss_fn, params, batches())["loss"]


@contextlib.contextmanager
def _deferred_interrupt() -> Iterator[dict[str, bool]]:
    """Ctrl-C sets a flag that the loop checks between steps (so the state saved is a whole
    step's); a second Ctrl-C interrupts at once."""
    flag = {"stop": False}

    def handler(signum, frame):
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: leave Ctrl-C alone
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


# -- saving and the end of a run ----------------------------------------------------------------
def _save(run: _Run, state: ft.TrainState, saver: ft.Saver) -> None:
    """A checkpoint in the run folder, written in the background (the next save and the end of
    the run wait for it): the state as laid out (a sharded or pipelined one is written by every
    process, each its own pieces; a whole one by rank 0), the resolved settings and the global
    data position."""
    cfg = run.cfg
    extra = {
        "config": cfg.to_dict(),
        "loader": run.recipe.loader.state_dict(),
        "world_size": run.world,
    }
    if run.main or is_sharded(state) or run.pipe is not None:
        # a LoRA run's checkpoint: the adapters and optimizer state, not the frozen base
        state = split_base(state)[0]
        saver.save_checkpoint(run.out, state, keep=cfg.keep, extra=extra, pipeline=run.pipe)


def _finish(run: _Run, state: ft.TrainState, report: _Report, interrupted: bool) -> dict[str, Any]:
    """The summary; on rank 0 also the end-of-run outputs, or after a Ctrl-C how to continue."""
    seconds = time.perf_counter() - report.t0
    summary = {"step": int(state.step), "seconds": seconds, "out": str(run.out), **report.last}
    params = _eval_params(run, state)  # whole (under sharding a collective: every process)
    if not run.main:
        return summary
    if interrupted:
        print(
            f"\nftrain train: interrupted at step {int(state.step)}; checkpoint saved in {run.out}. "
            f"Continue with: {_resume_command(run)}"
        )
        return {**summary, "interrupted": True}
    return _outputs(run, int(state.step), params, report, summary)


def _resume_command(run: _Run) -> str:
    """The command that continues this run with its saved settings (``--resume`` takes them):
    under torchrun, with as many processes (each node the same)."""
    command = f"ftrain train --out {run.out} --resume"
    if run.world == 1:
        return command
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", run.world))
    nodes = f"--nnodes {run.world // per_node} ... " if per_node != run.world else ""
    return f"torchrun {nodes}--nproc_per_node {per_node} -m {command}"  # -m ftrain train ...


def _outputs(
    run: _Run, step: int, params, report: _Report, summary: dict[str, Any]
) -> dict[str, Any]:
    """A completed run's last validation loss (if not just measured), loss.png, sample.txt and
    the lines printed; returns ``summary`` with the validation loss."""
    cfg, out, last, model = run.cfg, run.out, report.last, run.recipe.model
    if "val_loss" not in last and cfg.eval_every and run.recipe.valid is not None:
        report.validation(step, validation_loss(model, params, run.recipe.valid, cfg))
        summary.update(val_loss=last["val_loss"], val_perplexity=last["val_perplexity"])
    unit = "token" if cfg.model_dir else "byte"  # the model folder's tokenizer, or bytes
    run_folder.plot_losses(report.log.records(), out / "loss.png", unit=unit)
    text = ""
    if cfg.sample_tokens:
        text = finetune.end_sample(out, cfg, model, params)  # a chat model: a chat turn
        (out / "sample.txt").write_text(text)
    print(
        f"ftrain train: {step} steps in {summary['seconds']:.0f} s; "
        f"loss {last.get('loss', math.nan):.3f}"
        + (f", validation loss {last['val_loss']:.3f}" if "val_loss" in last else "")
        + f"\n  run: {out} (metrics.jsonl, loss.png, checkpoints)"
    )
    if text:
        print("--- sample ---\n" + text + "\n--------------")
    return summary


# -- collectives (no-ops with one process) ------------------------------------------------------
def _from_rank0(value: Any, world: int) -> Any:
    """Rank 0's ``value`` on every process (a broadcast; ``value`` as is with one process)."""
    if world == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any process: every process gets the same answer, so all stop
    at the same step. One all-reduce (MAX) of a 0-d int tensor, and its read is a host sync."""
    # NCCL reduces only CUDA tensors (the group's device); gloo, CPU ones
    t = torch.tensor(int(flag), device=group_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())
