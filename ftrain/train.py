"""The main job: train a byte-level GPT on the Python standard library.

    ftrain train                                   # defaults: a few minutes on a 2-core CPU
    ftrain train --precision bf16 --micro-batches 4 --checkpoint-policy blocks
    ftrain train --out runs/a --resume             # continue from the newest valid checkpoint
    torchrun --nproc_per_node 2 -m ftrain train --shard ddp
    ftrain sample --run runs/a --prompt "def "

Each piece is built by one small function below; :func:`build_step` is where the transforms are
composed. Everything a resumed run needs (params, optimizer state, step, RNG key, loss scale, data
position) is in the checkpoint, so a run stopped and resumed gives the same result, bit for bit on
a CPU, as a run that never stopped.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import inspect
import json
import math
import os
import platform
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import ftrain as ft
from ftrain import data, optim
from ftrain.config import TrainConfig, flag_name
from ftrain.models import GPT, GPTConfig, generate
from ftrain.transforms.shard import shard, shard_state, unshard, unshard_state

__all__ = [
    "build_data",
    "build_model",
    "build_optimizer",
    "build_step",
    "make_loss_fn",
    "train",
    "sample",
]


# -- the process ------------------------------------------------------------------------------
def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of handing it back to the OS.

    A training step allocates and frees the same activation buffers every step (about 170 MiB a
    step for the default model). With glibc's defaults the large ones are fresh ``mmap`` regions,
    or the top of the heap is trimmed and regrown, so every step page-faults its activations in
    again: millions of faults and seconds of kernel time over the default run. After this call
    buffers up to 32 MiB come from the heap and the heap keeps up to 1 GiB of free memory. Process
    wide, so ``ftrain train`` calls it for its own process and a library import never does.
    Returns whether it took effect (only with glibc; elsewhere it does nothing).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc's <malloc.h>
    settings = ((m_mmap_threshold, 32 << 20), (m_trim_threshold, 1 << 30), (m_top_pad, 64 << 20))
    return all(libc.mallopt(option, value) == 1 for option, value in settings)


# -- pieces -----------------------------------------------------------------------------------
def data_dir(cfg: TrainConfig) -> Path:
    if cfg.data_dir:
        return Path(cfg.data_dir)
    root = os.environ.get("FTRAIN_CACHE") or Path.home() / ".cache" / "ftrain"
    return Path(root) / "stdlib"


def build_data(cfg: TrainConfig, *, rank: int = 0, world: int = 1, quiet: bool = False):
    """The token build of the stdlib corpus (made once, then cached), the train loader for this
    process (an endless stream, resumable) and the validation dataset."""
    path = data_dir(cfg)
    data.build_token_dataset(data.corpora.python_stdlib(), path, progress=not quiet)
    train_ds = data.TokenDataset(path, cfg.seq_len, seed=cfg.seed, split="train")
    valid_ds = data.TokenDataset(path, cfg.seq_len, seed=cfg.seed, split="valid")
    rows = cfg.batch_size * cfg.micro_batches  # per process per optimizer step
    if world > 1:  # each process reads its own rows of one global batch
        loader = data.loader(
            _Strided(train_ds, rank, world),
            rows,
            seed=cfg.seed,
            infinite=True,
            num_workers=cfg.num_workers,
        )
    else:
        loader = data.loader(
            train_ds, rows, seed=cfg.seed, infinite=True, num_workers=cfg.num_workers
        )
    return loader, valid_ds


class _Strided:
    """Every ``world``-th sample starting at ``rank``: one process's share of the data."""

    def __init__(self, ds, rank: int, world: int):
        self.ds, self.rank, self.world = ds, rank, world

    def __len__(self) -> int:
        return (len(self.ds) - self.rank + self.world - 1) // self.world

    def __getitem__(self, i: int):
        return self.ds[i * self.world + self.rank]


def build_model(cfg: TrainConfig) -> GPT:
    """The GPT template (its own tensors are only used to initialize the params)."""
    torch.manual_seed(cfg.seed)
    return GPT(
        GPTConfig(
            vocab_size=data.ByteTokenizer().vocab_size,
            seq_len=cfg.seq_len,
            d_model=cfg.d_model,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            bias=cfg.bias,
            dropout=cfg.dropout,
            n_experts=cfg.n_experts,
            top_k=cfg.top_k,
        )
    )


def build_schedule(cfg: TrainConfig) -> optim.Schedule:
    total = cfg.decay_steps or cfg.max_steps  # the schedule never depends on where a run stops
    warm = min(cfg.warmup, total)
    if cfg.lr_schedule == "constant":
        return optim.join([optim.linear_warmup(cfg.lr, warm), optim.constant(cfg.lr)], [warm])
    if cfg.lr_schedule == "cosine":
        return optim.warmup_cosine(cfg.lr, warm, max(total, warm), end_value=cfg.lr / 10)
    if cfg.lr_schedule == "linear":
        return optim.join(
            [optim.linear_warmup(cfg.lr, warm), optim.linear_decay(cfg.lr, max(total - warm, 0))],
            [warm],
        )
    if cfg.lr_schedule == "wsd":
        decay = max(total // 5, 1)
        return optim.wsd(cfg.lr, warm, max(total - warm - decay, 0), decay)
    return optim.inverse_sqrt(cfg.lr, max(warm, 1))


def build_optimizer(cfg: TrainConfig) -> optim.GradientTransformation:
    """Clipping, then the chosen optimizer with weight decay on matrices only."""
    schedule = build_schedule(cfg)
    make = optim.OPTIMIZERS[cfg.optimizer]
    options = inspect.signature(make).parameters
    kwargs = {}
    if "weight_decay" in options:
        kwargs["weight_decay"] = cfg.weight_decay
    if "mask" in options:  # decoupled decay: matrices only, not biases or norms
        kwargs["mask"] = optim.decay_mask
    opt = make(schedule, **kwargs)
    if cfg.clip_grad:
        opt = optim.chain(optim.clip_by_global_norm(cfg.clip_grad), opt)
    return opt


def make_loss_fn(model: GPT):
    """Token cross-entropy, plus the mixture-of-experts balance loss when the model has one."""

    def loss_fn(params, batch):
        logits, aux = ft.apply(model, params, batch["input"], return_aux=True)
        ce = ft.losses.cross_entropy(logits, batch["target"])
        if not aux:
            return ce
        moe = sum(aux.values())
        return ft.Loss(ce.total + moe * ce.count, ce.count, {"moe_aux_loss": moe.detach()})

    return loss_fn


def build_step(cfg: TrainConfig, model: GPT, opt) -> ft.Step:
    """The composition, in one place. Autocast, checkpoint and accumulate act on different phases,
    so their order does not matter; shard must see the accumulated gradients (it reduces once per
    optimizer step) and compile comes last so it compiles everything."""
    step = ft.train_step(make_loss_fn(model), opt, donate=True)
    if cfg.precision != "fp32":
        step = ft.autocast(step, {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision])
    if cfg.checkpoint_policy != "none":
        step = ft.checkpoint(step, cfg.checkpoint_policy)
    if cfg.micro_batches > 1:
        step = ft.accumulate(step, cfg.micro_batches)
    if cfg.shard != "none":
        step = shard(step, cfg.shard)
    if cfg.compile:
        step = ft.compile(step)
    return step


@torch.no_grad()
def evaluate(model: GPT, params, dataset, cfg: TrainConfig) -> float:
    """Mean token loss over the first ``eval_batches`` batches of ``dataset`` (same every time)."""
    total = count = 0.0
    was_training = model.training
    model.eval()
    try:
        n = min(len(dataset), cfg.eval_batches * cfg.batch_size)
        for start in range(0, n, cfg.batch_size):
            rows = [dataset[i] for i in range(start, min(start + cfg.batch_size, n))]
            x = torch.stack([r["input"] for r in rows])
            y = torch.stack([r["target"] for r in rows])
            loss = ft.losses.cross_entropy(ft.apply(model, params, x), y)
            total += float(loss.total)
            count += float(loss.count)
    finally:
        model.train(was_training)
    return total / max(count, 1.0)


# -- the run directory --------------------------------------------------------------------------
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
    """The run directory, created and checked writable before any work starts."""
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


class _MetricsLog:
    """``metrics.jsonl``: one JSON object per line; on resume, lines past the resumed step (from a
    run that died after logging them) are dropped so the log reads as one run."""

    def __init__(self, path: Path, resumed_step: int):
        self.path = path
        if resumed_step and path.exists():
            keep = [ln for ln in path.read_text().splitlines() if _line_step(ln) <= resumed_step]
            path.write_text("".join(ln + "\n" for ln in keep))
        elif path.exists():
            path.unlink()

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 0


def plot_losses(records: list[dict[str, Any]], path: Path) -> None:
    """A loss-curve PNG (train loss per logged step, validation loss where measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    valid = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train")
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("ftrain train")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


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


# -- the loop -----------------------------------------------------------------------------------
def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as ``cfg`` says; returns a summary (steps, final loss, validation loss, seconds)."""
    from ftrain import distributed

    if cfg.shard == "none" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        cfg.shard = "ddp"  # under torchrun without --shard: plain data parallelism
    if cfg.shard != "none":
        try:
            distributed.init()
        except RuntimeError as e:
            raise SystemExit(f"ftrain train: --shard {cfg.shard}: {e}") from None
    rank, world = distributed.rank_and_world()
    main = rank == 0
    if cfg.global_batch_size is not None:
        per_step = cfg.batch_size * world
        if cfg.global_batch_size % per_step:
            raise SystemExit(
                f"ftrain train: --global-batch-size {cfg.global_batch_size} must be a multiple of "
                f"--batch-size x world size = {cfg.batch_size} x {world} = {per_step}"
            )
        cfg.micro_batches = cfg.global_batch_size // per_step
    out = prepare_out(cfg) if main else None
    out = Path(_from_rank0(str(out) if main else None, world))  # every process: rank 0's folder

    loader, valid_ds = build_data(cfg, rank=rank, world=world, quiet=not main)
    model = build_model(cfg)
    opt = build_optimizer(cfg)
    state = ft.TrainState.create(ft.params_of(model), opt, seed=cfg.seed)
    step_fn = build_step(cfg, model, opt)
    state = step_fn.init_extra(state)

    start = 0
    if cfg.resume:
        # rank 0 looks (latest_checkpoint may tidy what an interrupted save left); all load
        latest = _from_rank0(ft.latest_checkpoint(out) if main else None, world)
        if latest is None:
            if main:
                print(f"ftrain train: --resume: no checkpoint in {out}; starting from step 0")
        else:
            meta = ft.load_meta(latest)
            _check_world_size(meta, world)
            _check_resumed_config(cfg, _saved_config(meta), main)
            state = ft.load(latest, like=state)  # whole tensors: sharded below
            extra = meta["extra"]
            loader.load_state_dict(extra.get("loaders", [extra["loader"]])[rank])
            start = int(state.step)
            if main:
                print(f"ftrain train: resumed from {latest} (step {start})")
    if cfg.shard != "none":
        state = shard_state(state, cfg.shard)
    log = _MetricsLog(out / "metrics.jsonl", start) if main else None
    if main:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    def save() -> None:
        # Every process takes part (gathering a sharded state is a collective); rank 0 writes
        # whole tensors, with each process's data position.
        whole = unshard_state(state) if cfg.shard != "none" else state
        loaders = _all_ranks(loader.state_dict(), world)
        if main:
            extra = {
                "config": cfg.to_dict(),
                "loader": loaders[0],
                "loaders": loaders,
                "world_size": world,
            }
            ft.save_checkpoint(out, whole, keep=cfg.keep, extra=extra)
        if world > 1:
            torch.distributed.barrier()

    tokens_per_step = cfg.batch_size * cfg.micro_batches * cfg.seq_len * world
    bar = None
    if main and cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=start, unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    t_log, step_at_log = t0, start
    metrics: dict[str, torch.Tensor] = {}
    last: dict[str, float] = {}
    interrupted = False
    # Leaving the block stops the loader's threads (its position, saved below, stays).
    with iter(loader) as batches, _deferred_interrupt() as flag:
        for i in range(start, cfg.max_steps):
            state, metrics = step_fn(state, next(batches))
            n = i + 1
            if n % cfg.log_every == 0 or n == cfg.max_steps:
                now = time.perf_counter()  # float() below is the host sync of this log step
                last = {k: float(v) for k, v in metrics.items()}
                rec = {"step": n, **last}
                rec["tokens_per_s"] = tokens_per_step * (n - step_at_log) / max(now - t_log, 1e-9)
                rec["elapsed_s"] = now - t0
                t_log, step_at_log = now, n
                if log is not None:
                    log.write(rec)
                if bar is not None:
                    bar.set_postfix(
                        loss=f"{last['loss']:.3f}",
                        tok_s=f"{rec['tokens_per_s']:.0f}",
                        lr=f"{last['lr']:.2e}",
                    )
            if cfg.eval_every and n % cfg.eval_every == 0:
                params = unshard(state.params)  # under fsdp a collective: every process
                if main:
                    val = evaluate(model, params, valid_ds, cfg)
                    log.write({"step": n, "val_loss": val})
                    last["val_loss"] = val
                    if bar is not None:
                        bar.write(f"step {n}: validation loss {val:.4f}")
            if cfg.save_every and n % cfg.save_every == 0 and n != cfg.max_steps:
                save()
            if bar is not None:
                bar.update(1)
            if world > 1:  # stop together: a process that stops alone leaves the others waiting
                flag["stop"] = bool(_all_ranks(flag["stop"], world).count(True))
            if flag["stop"]:
                interrupted = True
                break
    if bar is not None:
        bar.close()
    save()
    seconds = time.perf_counter() - t0
    summary = {"step": int(state.step), "seconds": seconds, "out": str(out), **last}
    params = unshard(state.params)  # whole params (under fsdp a collective: every process)
    if not main:
        return summary
    if interrupted:
        print(
            f"\nftrain train: interrupted at step {int(state.step)}; checkpoint saved in {out}. "
            f"Continue with: ftrain train --out {out} --resume"
        )
        summary["interrupted"] = True
        return summary
    if "val_loss" not in last and cfg.eval_every:
        last["val_loss"] = summary["val_loss"] = evaluate(model, params, valid_ds, cfg)
        log.write({"step": int(state.step), "val_loss": last["val_loss"]})
    plot_losses(log.records(), out / "loss.png")
    text = ""
    if cfg.sample_tokens:
        text = sample_text(model, params, "def ", cfg.sample_tokens, seed=cfg.seed)
        (out / "sample.txt").write_text(text)
    print(
        f"ftrain train: {int(state.step)} steps in {seconds:.0f} s; loss {last.get('loss', math.nan):.3f}"
        + (f", validation loss {last['val_loss']:.3f}" if "val_loss" in last else "")
        + f"\n  run: {out} (metrics.jsonl, loss.png, checkpoints)"
    )
    if text:
        print("--- sample ---\n" + text + "\n--------------")
    return summary


def _from_rank0(value: Any, world: int) -> Any:
    """Rank 0's ``value`` on every process (a broadcast; ``value`` as is with one process)."""
    if world == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _all_ranks(value: Any, world: int) -> list[Any]:
    """Every process's ``value``, in rank order (an all-gather; ``[value]`` with one process)."""
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, value)
    return out


def _check_world_size(meta: dict, world: int) -> None:
    """Refuse to resume with another number of processes: each process's share of the data and
    the global batch depend on it, so the run would not continue as it would have."""
    saved = meta["extra"].get("world_size", 1)
    if saved != world:
        raise SystemExit(
            f"ftrain train: --resume: the checkpoint was written by {saved} process(es), this run "
            f"has {world}. The data each process reads and the global batch depend on that number, "
            f"so the run would not continue as it would have: resume with "
            f"`torchrun --nproc_per_node {saved} -m ftrain train ... --resume`. (The state itself is "
            "saved whole: ft.load(path) and ft.shard_state(state, strategy) lay it out for any "
            "number of processes, e.g. to fine-tune from it.)"
        )


# Settings that fix the model, the data or the random stream: a run cannot continue exactly
# with another value. The others (lr, max_steps, logging, ...) may change on --resume.
RESUME_FIXED = ("seed", "seq_len", "d_model", "n_layer", "n_head", "bias", "n_experts", "top_k",
                "batch_size", "data_dir")  # fmt: skip
_NOT_COMPARED = ("out", "resume", "config", "progress")
# Settings added after checkpoints were first written, with the value those runs had.
_BEFORE_ADDED = {"bias": True}


def _saved_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The run settings saved in a checkpoint's ``meta``; a setting that did not exist when it was
    written gets the value runs had then (``bias``: True), not today's default."""
    saved = meta["extra"].get("config", {})
    return {**_BEFORE_ADDED, **saved} if saved else {}


def _check_resumed_config(cfg: TrainConfig, saved: dict[str, Any], main: bool) -> None:
    """On --resume: a setting of RESUME_FIXED that differs from the checkpoint's is a usage error
    (exit 2) naming each, saved and new value; other changes get a one-line note on stderr."""
    now = cfg.to_dict()
    diff = {
        k: (saved[k], now[k])
        for k in now
        if k in saved and k not in _NOT_COMPARED and saved[k] != now[k]
    }
    fixed = [f"--{flag_name(k)} {a!r} -> {b!r}" for k, (a, b) in diff.items() if k in RESUME_FIXED]
    if fixed:
        print(
            f"ftrain train: error: --resume: these settings differ from the checkpoint's and "
            f"would not continue the same run: {', '.join(fixed)} (saved -> new); resume with "
            f"the saved values, or train into another --out for a new run",
            file=sys.stderr,
        )
        raise SystemExit(2)
    changed = [f"--{flag_name(k)} {a!r} -> {b!r}" for k, (a, b) in diff.items()]
    if changed and main:
        print(
            f"ftrain train: note: --resume with changed settings: {', '.join(changed)}",
            file=sys.stderr,
        )


def sample_text(
    model: GPT,
    params,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> str:
    """Generate from ``params`` with the model's code (the template's own tensors are not used).

    An empty ``prompt`` samples unconditionally, from the start of a document."""
    tok = data.ByteTokenizer()
    # An empty prompt starts from the end-of-document token (dropped by decode): unconditional.
    ids = torch.tensor([tok.encode(prompt) or [tok.eot_id]], dtype=torch.long)
    model = copy.deepcopy(model)  # the template stays untouched
    model.load_state_dict(ft.state_dict_of(params), strict=False)  # strict=False: tied weights
    model.eval()
    out = generate(
        model,
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        generator=torch.Generator().manual_seed(seed),
    )
    return tok.decode(out[0].tolist())


def sample(
    run: str | Path,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int = 0,
) -> str:
    """Text from the newest valid checkpoint of ``run``."""
    run = Path(run)
    latest = ft.latest_checkpoint(run) if not (run / "meta.json").exists() else run
    if latest is None:
        raise SystemExit(f"ftrain sample: no checkpoint in {run}")
    meta = ft.load_meta(latest)
    cfg = TrainConfig(**{k: v for k, v in _saved_config(meta).items() if k != "config"})
    model = build_model(cfg)
    state = ft.load(latest)
    return sample_text(
        model, state.params, prompt, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: ftrain train")
