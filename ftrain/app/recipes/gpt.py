"""The built-in recipe: a byte-level GPT on the Python standard library.

    ftrain train                                          # this recipe, with its defaults
    ftrain train --precision bf16 --micro-batches 4 --checkpoint-policy blocks
    ftrain sample --run runs/a --prompt "def "            # ftrain.app.recipes.sample: sample_text

    from ftrain.app.config import TrainConfig
    from ftrain.app.recipes import gpt
    recipe = gpt.build(TrainConfig(max_steps=100))       # model, step, state, loader, valid
    with iter(recipe.loader) as batches:                  # leaving it stops the loader's threads
        state, metrics = recipe.step(recipe.state, next(batches))

Each piece is one small function of the settings; :func:`build_step` is the one place where the
transforms are composed. The loop (``ftrain.app.loop``) calls only :func:`build` and
:func:`sample_text`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

import ftrain as ft
from ftrain import data, optim
from ftrain.app import model_parallel, run_folder
from ftrain.app.config import TrainConfig
from ftrain.app.recipes import corpus, placement, rows, startup
from ftrain.models import GPT, GPTConfig, choose_matmul, generate
from ftrain.transforms import Lora, offloaded

__all__ = [
    "Recipe",
    "SCHEDULE_FREE",
    "born_sharded",
    "build",
    "build_data",
    "build_lora",
    "build_model",
    "build_optimizer",
    "build_schedule",
    "build_state",
    "build_model_and_state",
    "build_step",
    "data_dir",
    "eval_params",
    "generate_from",
    "make_loss_fn",
    "model_config",
    "resolve_matmul",
    "run_config",
    "sample_text",
    "set_peak_lr",
]


class Recipe(NamedTuple):
    """What the loop trains, built from the settings by :func:`build`."""

    model: GPT  # the template: its code runs the params; its own params are on meta (released)
    step: ft.Step  # the composed step (build_step)
    state: ft.TrainState  # at step 0: params, optimizer state, RNG key, the transforms' entries
    loader: data.Loader  # this process's batches of one global batch: endless, resumable
    valid: data.TokenDataset | None  # the validation rows (the same on every process); None: off
    cfg: TrainConfig | None = None  # the settings resolved (--epochs -> max_steps): what trains
    summary: str = ""  # startup.summary: data, rows per step, epochs, params, device


def build(cfg: TrainConfig, *, rank: int = 0, world: int = 1, quiet: bool = False) -> Recipe:
    """Everything ``cfg`` describes, for process ``rank`` of ``world``, at step 0 (the state is
    whole, the loop lays it out across processes; under ``--shard fsdp`` it is born as this
    process's shards: :func:`build_model_and_state`). The same ``cfg`` gives the same recipe.

    The model template, the state and the loader's batches are on ``cfg.device`` (resolved by
    ``placement.resolve``: ``auto`` is the GPU when there is one); the init is the same on every
    device (built on the CPU from ``cfg.seed``, then moved). ``recipe.cfg`` is ``cfg`` resolved
    (device, precision, ``--epochs`` as ``max_steps``): the settings the loop runs and records."""
    cfg = placement.resolve(cfg)
    built = rows.build(cfg, rank=rank, world=world, quiet=quiet)
    cfg = rows.with_length(cfg, built.train, world)  # --epochs N -> max_steps, before the schedule
    opt = build_optimizer(cfg)
    mesh = model_parallel.build_mesh(cfg)  # one mesh: state and step
    model, state = build_model_and_state(cfg, opt, world, mesh=mesh)
    step = build_step(cfg, model, opt, mesh=mesh)
    placement.release_params(model)  # the state holds the params: the template's go to meta
    about = startup.summary(cfg, built, state, world)
    return Recipe(model, step, step.init_extra(state), built.loader, built.valid, cfg, about)


# -- data -------------------------------------------------------------------------------------
def data_dir(cfg: TrainConfig) -> Path:
    """The token cache: ``--data-dir``, else ``$FTRAIN_CACHE/stdlib``, else
    ``~/.cache/ftrain/stdlib`` (with ``--data`` or ``--model-dir``: ``corpus.cache_dir``)."""
    return corpus.cache_dir(cfg)


def build_data(
    cfg: TrainConfig, *, rank: int = 0, world: int = 1, quiet: bool = False, tokenizer=None
) -> tuple[data.Loader, data.TokenDataset | None]:
    """The train loader for this process (an endless stream, resumable) and the validation rows
    (None: validation off), as ``rows.build`` makes them from ``--data`` / ``--eval-data`` /
    ``--val-fraction`` (with ``--pack``: rows with position ids)."""
    built = rows.build(cfg, rank=rank, world=world, quiet=quiet, tokenizer=tokenizer)
    return built.loader, built.valid


# -- model and loss ---------------------------------------------------------------------------
def resolve_matmul(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``matmul`` resolved, as ``placement.resolve`` resolves the device: a kernel
    named stays; ``auto`` is ``torch`` on a GPU and for a ``--model-dir`` model (whose linears
    are its own), and on the CPU the faster of ``onednn`` and ``torch`` for this model's shapes
    at ``batch_size * seq_len`` rows per forward (``ftrain.models.choose_matmul``: timed once
    per processor, then cached; a tiny model's is ``torch``, untimed). ``cfg`` is not changed.

    **Invariant:** the result's ``matmul`` is a kernel, never ``auto``, and resolves to itself.
    The kernels agree only to float32 rounding: the loop records the answer (config.json and
    every checkpoint) and a resumed run builds with it, untimed."""
    if cfg.matmul != "auto":
        return cfg
    if cfg.model_dir or placement.resolve_device(cfg.device).type != "cpu":
        return dataclasses.replace(cfg, matmul="torch")
    kernel = choose_matmul(model_config(cfg), rows=cfg.batch_size * cfg.seq_len)
    return dataclasses.replace(cfg, matmul=kernel)


def model_config(cfg: TrainConfig) -> GPTConfig:
    """The ``GPTConfig`` of the run's settings (the byte vocabulary; ``matmul`` as ``cfg``'s)."""
    return GPTConfig(
        vocab_size=data.ByteTokenizer().vocab_size,
        seq_len=cfg.seq_len,
        d_model=cfg.d_model,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        bias=cfg.bias,
        dropout=cfg.dropout,
        n_experts=cfg.n_experts,
        top_k=cfg.top_k,
        matmul=cfg.matmul,
    )


def build_model(cfg: TrainConfig) -> GPT:
    """The GPT template, initialized from ``cfg.seed`` (its tensors only initialize the params),
    its linears of the kernel :func:`resolve_matmul` gives (the recorded one on ``--resume``).
    The global (CPU) random generator is left as it was."""
    config = model_config(resolve_matmul(cfg))
    with torch.random.fork_rng(devices=[]):  # the model is built on the CPU
        torch.manual_seed(cfg.seed)
        return GPT(config)


def make_loss_fn(model: GPT, fp32: bool = True):
    """Token cross-entropy (``fp32`` as ``ft.losses.cross_entropy``'s), plus the mixture-of-experts
    balance loss when the model has one (reported as the metric ``moe_aux_loss``)."""

    def loss_fn(params, batch):
        packed = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        logits, aux = ft.apply(model, params, batch["input"], return_aux=True, **packed)
        ce = ft.losses.cross_entropy(logits, batch["target"], fp32=fp32)
        if not aux:
            return ce
        moe = sum(aux.values())
        return ft.Loss(ce.total + moe * ce.count, ce.count, {"moe_aux_loss": moe.detach()})

    return loss_fn


def build_lora(cfg: TrainConfig, model: torch.nn.Module) -> Lora | None:
    """``ft.lora`` on ``model`` as ``--lora-rank/--lora-alpha/--lora-targets`` say, or None
    (``--lora-rank 0``). A pattern that selects no linear layer is a usage error, raised now."""
    if not cfg.lora_rank:
        return None
    targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    try:
        return ft.lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=targets)
    except ValueError as e:
        raise SystemExit(f"ftrain train: --lora-targets {cfg.lora_targets}: {e}") from None


def build_state(
    cfg: TrainConfig, model: torch.nn.Module, opt: optim.GradientTransformation, params=None
) -> ft.TrainState:
    """The state at step 0: ``model``'s params (or ``params``, e.g. this process's shards read
    from the files) and ``opt``'s state, or with ``--lora-rank`` the adapters as the params (the
    model's own frozen in ``state.extra["lora"]``). With ``--offload`` the optimizer state is
    created on the host: it never takes device memory."""
    if cfg.offload != "none":
        opt = offloaded(opt)
    params = ft.params_of(model) if params is None else params
    lora = build_lora(cfg, model)
    if lora is not None:
        return lora.init_state(params, opt, seed=cfg.seed)
    return ft.TrainState.create(params, opt, seed=cfg.seed)


def born_sharded(cfg: TrainConfig, world: int) -> bool:
    """Whether the state is born as this process's fsdp shards (never whole on any process):
    ``--shard fsdp`` over two or more processes (``--tp``: its pieces split over the dp groups;
    ``--lora-rank``: the frozen base). Not with ``--pp``: built whole, then laid out (lay_out)."""
    return cfg.shard == "fsdp" and world > 1 and cfg.pp == 1


def build_model_and_state(
    cfg: TrainConfig, opt: optim.GradientTransformation, world: int = 1, *, mesh=None
) -> tuple[GPT, ft.TrainState]:
    """The model template and the state at step 0: :func:`build_model` on ``cfg.device`` and
    :func:`build_state`; or where :func:`born_sharded`, a template on ``meta`` and the state
    from ``ft.distributed.sharded_init`` (this process's fsdp shards, the model never whole;
    with ``--tp``, laid out for tensor parallelism on ``mesh``, the ``("dp", "tp")`` mesh the
    step uses, made here if not given).

    **Invariant:** the born state is bitwise ``ft.shard_state(build_state(...), "fsdp")``
    (with ``--tp``: of ``tp.shard_state(build_state(...))`` over the mesh's ``dp``; with
    ``--lora-rank``, once the loop has sharded the adapters)."""
    if not born_sharded(cfg, world):
        model = build_model(cfg).to(cfg.device)
        return model, build_state(cfg, model, opt)
    config = model_config(resolve_matmul(cfg))
    with torch.device("meta"):
        model = GPT(config)  # the template: ft.apply runs its code on the state's params
    layout, dp = None, None
    if cfg.tp > 1:
        mesh = mesh if mesh is not None else ft.distributed.tp_mesh(cfg.tp)
        layout, dp = (
            model_parallel.build_tensor_parallel(cfg, model, mesh).lay_out_param,
            mesh["dp"],
        )
    lora = build_lora(cfg, model)
    if lora is not None:  # the frozen base born sharded; the adapters whole (the loop shards them)
        base = ft.distributed.sharded_init(
            lambda: GPT(config), optim.identity(), "fsdp", dp, seed=cfg.seed, layout=layout
        ).params
        return model, lora.init_state(base, opt, seed=cfg.seed)
    state = ft.distributed.sharded_init(
        lambda: GPT(config), opt, "fsdp", dp, seed=cfg.seed, layout=layout
    )
    return model, state


# -- optimizer --------------------------------------------------------------------------------
def build_schedule(cfg: TrainConfig) -> optim.Schedule:
    """The learning rate by step: a linear warmup to ``cfg.lr``, then the named shape over
    ``decay_steps`` (default ``max_steps``)."""
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
    """Clipping, then the chosen optimizer with weight decay on matrices only, its peak learning
    rate injected (``optim.inject_hyperparams``).

    The learning rate at step ``n`` is ``peak * shape(n)``: ``peak`` is a tensor of the optimizer
    state, ``opt_state["hyperparams", "learning_rate"]`` (``cfg.lr`` at step 0), and ``shape`` is
    :func:`build_schedule` with a peak of 1 (warmup, then the named decay). Setting the peak
    (:func:`set_peak_lr`; ``ftrain train --resume --lr X`` does) rescales the rest of the
    schedule from the next step on; the warmup and decay keep their lengths and their position.
    An optimizer that takes ``warmup_steps`` (schedule-free) warms up itself and needs no decay:
    its shape is 1, and ``--lr-schedule`` and ``--decay-steps`` do not apply.
    """
    make = optim.OPTIMIZERS[cfg.optimizer]
    options = inspect.signature(make).parameters
    kwargs = {}
    if "warmup_steps" in options:
        kwargs["warmup_steps"] = cfg.warmup
        shape = optim.constant(1.0)
    else:
        shape = build_schedule(dataclasses.replace(cfg, lr=1.0))
    if "weight_decay" in options:
        kwargs["weight_decay"] = cfg.weight_decay
    if "mask" in options:  # decoupled decay: matrices only, not biases or norms
        kwargs["mask"] = optim.decay_mask

    def with_peak(learning_rate: optim.Schedule) -> optim.GradientTransformation:
        opt = make(lambda n: learning_rate(n) * shape(n), **kwargs)
        if cfg.clip_grad:
            opt = optim.chain(optim.clip_by_global_norm(cfg.clip_grad), opt)
        return opt

    return optim.inject_hyperparams(with_peak)(learning_rate=cfg.lr)


def set_peak_lr(state: ft.TrainState, lr: float) -> ft.TrainState:
    """``state`` with the peak learning rate of :func:`build_optimizer`'s optimizer set to ``lr``
    (used from the next step on; ``state`` is left as it was)."""
    return optim.set_hyperparams(state, learning_rate=lr)


# The --optimizer names whose params to evaluate are not the trained ones (see eval_params).
SCHEDULE_FREE = ("schedule_free_adamw",)


def eval_params(cfg: TrainConfig, state: ft.TrainState):
    """The params to evaluate, sample and export with: ``state.params``, or for a schedule-free
    optimizer the average its state describes (``optim.schedule_free_eval_params``), with LoRA
    adapters folded into the frozen base (``ft.merge_lora``). Pure: the
    state, which checkpoints keep as trained, is not changed. ``state`` must hold whole tensors."""
    params = state.params
    if cfg.optimizer in SCHEDULE_FREE:
        params = optim.schedule_free_eval_params(state.opt_state, state.params)
    if "lora" in state.extra.keys():  # the adapters folded into the frozen base
        return ft.merge_lora(state.replace(params=params))
    return params


# -- the step ---------------------------------------------------------------------------------
def build_step(
    cfg: TrainConfig, model: GPT, opt: optim.GradientTransformation, *, loss_fn=None, mesh=None
) -> ft.Step:
    """The composition, in one place, innermost first (``loss_fn``: default ``make_loss_fn``;
    the Hugging Face recipe passes its own; ``mesh``: the mesh of ``--tp`` or ``--pp``
    (``model_parallel.build_mesh``), made here if not given).

    Autocast, checkpoint and accumulate act on different phases (the forward's precision, what it
    keeps for backward, how a batch is split), so their order among themselves does not matter.
    Shard wraps the accumulated step so that it reduces the gradients once per optimizer step, not
    once per micro-batch. Offload comes before shard (and tensor parallel) so that the optimizer
    it moves to the host is the one each rank runs on its own shards. Compile compiles every
    transform of the step wherever it sits; it comes last here only so that the composition reads
    in the order the step is built.

    Precision: ``cfg.precision`` resolved for ``cfg.device`` (``auto``: bf16 on a GPU that has
    it, fp32 on the CPU); on a GPU with TF32, fp32 matmuls use it for the step's extent
    (``ft.autocast(tf32=True)``) unless ``--no-tf32``; fp32 on the CPU adds no transform.
    """
    cfg = placement.resolve(cfg)
    step = ft.train_step(loss_fn or make_loss_fn(model, cfg.loss_fp32), opt, donate=True)
    lora = build_lora(cfg, model)
    if lora is not None:  # the step's params are the adapters
        step = lora(step)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision]
    tf32 = placement.tf32_applies(cfg)
    if dtype is not torch.float32 or tf32:
        step = ft.autocast(step, dtype, tf32=tf32)
    if cfg.checkpoint_policy != "none":
        step = ft.checkpoint(step, cfg.checkpoint_policy)
    if cfg.micro_batches > 1:
        step = ft.accumulate(step, cfg.micro_batches)
    if cfg.offload != "none":  # before shard: each rank's ZeRO/fsdp optimizer offloads its shards
        step = ft.offload(step, cfg.offload)
    if cfg.pp > 1:  # the blocks over pp processes (their matrices over tp), the batch over dp
        mesh = mesh if mesh is not None else model_parallel.build_mesh(cfg)
        if cfg.tp > 1:
            step = model_parallel.build_tensor_parallel(cfg, model, mesh)(step)
        step = model_parallel.build_pipeline(cfg, model, mesh)(step)
        step = ft.shard(step, cfg.shard if cfg.shard != "none" else "ddp", mesh=mesh["dp"])
    elif cfg.tp > 1:  # the matrices over tp processes, the batch (and with zero/fsdp the state)
        mesh = mesh if mesh is not None else ft.distributed.tp_mesh(cfg.tp)  # over the dp groups
        step = model_parallel.build_tensor_parallel(cfg, model, mesh)(step)
        step = ft.shard(step, cfg.shard if cfg.shard != "none" else "ddp", mesh=mesh["dp"])
    elif cfg.shard != "none":
        step = ft.shard(step, cfg.shard)
    if cfg.compile:
        step = ft.compile(step)
    return step


# -- text -------------------------------------------------------------------------------------
# Sampling lives with the recipe, not the loop: it needs this recipe's model and tokenizer and
# nothing of training (the loop calls sample_text at the end of a run, ftrain.app.recipes.sample
# from a run's checkpoint).
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
    """``prompt`` and ``max_new_tokens`` bytes generated from ``params`` with the model's code;
    the same ``seed`` gives the same text, and ``model`` itself is not changed.

    An empty ``prompt`` samples unconditionally, from the start of a document."""
    tok = data.ByteTokenizer()
    # An empty prompt starts from the end-of-document token (dropped by decode): unconditional.
    ids = torch.tensor([tok.encode(prompt) or [tok.eot_id]], dtype=torch.long)
    out = generate_from(model, params, ids, max_new_tokens, temperature=temperature, top_k=top_k,
                        seed=seed)  # fmt: skip
    return tok.decode(out[0].tolist())


def generate_from(
    model: torch.nn.Module,
    params,
    ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float,
    top_k: int | None,
    seed: int,
    seq_len: int | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
) -> torch.Tensor:
    """``ftrain.models.generate`` of the token ids ``ids`` (B, T) run with ``params`` in eval
    mode, from a generator seeded with ``seed`` (the same seed gives the same tokens). ``model``
    is not changed and its own params are not read (``ft.apply`` runs an eval-mode copy of it
    with ``params``; a released template works). It runs on the params' device (the ids and the
    generator go there; the result too)."""
    leaves = ft.tree.flatten(params)[0]
    device = leaves[0].device if leaves else ids.device  # a model without params: the ids'
    applied = _Applied(copy.deepcopy(model), params).eval()  # the template stays untouched
    generator = torch.Generator(device=device).manual_seed(seed)
    return generate(applied, ids.to(device), max_new_tokens, temperature=temperature, top_k=top_k,
                    generator=generator, seq_len=seq_len, stop_sequences=stop_sequences)  # fmt: skip


class _Applied(torch.nn.Module):
    """``model`` run with ``params`` (``ft.apply``): what ``generate`` samples from. It has the
    model's ``config`` (``generate`` reads the context length there)."""

    def __init__(self, model: torch.nn.Module, params) -> None:
        super().__init__()
        self.model, self.params = model, params
        self.config = getattr(model, "config", None)

    def forward(self, idx: torch.Tensor):
        return ft.apply(self.model, self.params, idx)


def run_config(run: str | Path, command: str = "ftrain sample") -> tuple[Path, TrainConfig]:
    """The newest valid checkpoint of the run folder ``run`` (or the checkpoint folder ``run``)
    and the settings it was trained with (those this version knows). Without a checkpoint,
    ``SystemExit`` naming ``command`` and ``run``."""
    run = Path(run)
    latest = ft.latest_checkpoint(run) if not (run / "meta.json").exists() else run
    if latest is None:
        raise SystemExit(f"{command}: no checkpoint in {run}")
    saved: dict[str, Any] = run_folder.saved_config(ft.load_meta(latest))
    # Only this version's settings: a checkpoint written by another version may hold others.
    known = {f.name for f in dataclasses.fields(TrainConfig)} - {"config"}
    return latest, TrainConfig(**{k: v for k, v in saved.items() if k in known})
