"""The main job's settings: one dataclass, one flag per field, and TOML files with the same keys.

Each field documents itself in ``metadata["help"]``; the command line is generated from them, so a
flag and its config key can never drift apart (``--d-model`` <-> ``d_model``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import typing
from pathlib import Path
from typing import Any

from ftrain.app.run_settings import RESOLVED_HERE, flag_name, rehome, resumed_values
from ftrain.app.settings_file import read_settings

__all__ = [
    "RESOLVED_HERE",
    "TrainConfig",
    "add_arguments",
    "flag_name",
    "from_args",
    "load_settings",
    "load_toml",
    "rehome",
]

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
CHECKPOINT_POLICIES = ("none", "blocks", "selective")
SCHEDULES = ("cosine", "constant", "linear", "wsd", "inverse_sqrt")
SHARD_STRATEGIES = ("none", "ddp", "zero1", "zero2", "fsdp")
OFFLOAD_MODES = ("none", "optimizer", "optimizer+gradients")  # ftrain.transforms.offload.MODES
# ftrain.distributed.pipeline.SCHEDULES (torch.distributed.pipelining's, by ft.pipeline's names)
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble", "zbv")
SINK_NAMES = ("jsonl", "tensorboard")  # ftrain.app.sinks.SINKS
MATMULS = ("auto", "onednn", "torch")  # ftrain.models.MATMULS and "auto"
DEFAULT_MAX_STEPS = 600  # --max-steps; --epochs replaces it


def _f(default, help: str, **kw):
    return dataclasses.field(default=default, metadata={"help": help, **kw})


@dataclasses.dataclass
class TrainConfig:
    """Everything ``ftrain train`` needs. Defaults train a byte-level GPT on the Python standard
    library in a few minutes on a 2-core CPU."""

    # -- run ------------------------------------------------------------------------------------
    out: str | None = _f(None, "run directory (default: runs/<date-time>)", metavar="DIR")
    resume: bool = _f(False, "continue from the newest valid checkpoint in --out")
    config: str | None = _f(
        None,
        "TOML or JSON file with these settings, e.g. a run's config.json (flags override it)",
        metavar="FILE",
    )
    seed: int = _f(0, "seed for init, data order and dropout")
    max_steps: int = _f(DEFAULT_MAX_STEPS, "optimizer steps to train for (or --epochs)")
    # -- model ----------------------------------------------------------------------------------
    seq_len: int = _f(128, "context length in tokens (bytes for the built-in byte-level GPT)")
    d_model: int = _f(128, "width of the residual stream")
    n_layer: int = _f(4, "transformer blocks")
    # 2 heads of 64 channels and no biases: as good a model as 4 heads of 32 with biases, and a
    # faster step on a CPU (larger attention matmuls; no bias adds and bias gradients).
    n_head: int = _f(2, "attention heads (d_model must divide by it; head size d_model / n_head)")
    bias: bool = _f(False, "biases in the Linear and LayerNorm layers")
    dropout: float = _f(0.0, "dropout probability")
    n_experts: int = _f(0, "mixture-of-experts feed-forward with this many experts (0 = dense)")
    top_k: int = _f(1, "experts per token when n_experts > 0")
    model_dir: str | None = _f(
        None,
        "train this Hugging Face causal LM instead (a save_pretrained folder with its tokenizer; "
        "local files only; the model flags above then do not apply)",
        metavar="DIR",
    )
    # -- batch ----------------------------------------------------------------------------------
    batch_size: int = _f(16, "rows per micro-batch per process (one forward/backward)")
    micro_batches: int = _f(1, "micro-batches accumulated per optimizer step")
    global_batch_size: int | None = _f(
        None,
        "rows per optimizer step over all processes; sets micro_batches = "
        "global / (batch_size * world_size)",
    )
    # -- transforms -----------------------------------------------------------------------------
    checkpoint_policy: str = _f("none", "activation checkpointing", choices=CHECKPOINT_POLICIES)
    precision: str = _f(
        "auto",
        "forward precision (params stay fp32); auto: bf16 on a GPU that has it, fp32 on the CPU",
        choices=PRECISIONS,
    )
    loss_fp32: bool = _f(
        True,
        "the loss's log-probabilities in fp32 (exact); --no-loss-fp32: in the forward's bf16/fp16, "
        "as F.cross_entropy under autocast (nanoGPT's): less time and memory on a GPU",
    )
    compile: bool = _f(False, "torch.compile the whole step (slow to start on a CPU)")
    shard: str = _f("none", "data parallelism under torchrun", choices=SHARD_STRATEGIES)
    offload: str = _f(
        "none", "optimizer state and update on the host CPU (ft.offload)", choices=OFFLOAD_MODES
    )
    tp: int = _f(
        1,
        "tensor parallel under torchrun: each block's matrices split over TP processes, the batch "
        "over world / TP groups of them (--shard ddp/zero1/zero2/fsdp over those groups)",
    )
    pp: int = _f(
        1,
        "pipeline parallel under torchrun: the blocks cut into PP stages over PP processes, the "
        "batch over world / PP groups of them (--shard ddp/zero1/zero2 over those groups)",
    )
    pp_schedule: str = _f(
        "1f1b", "with --pp: torch.distributed.pipelining's schedule", choices=PP_SCHEDULES
    )
    pp_microbatches: int | None = _f(
        None, "with --pp: micro-batches the schedule splits each batch into (default 2 x stages)"
    )
    sequence_parallel: bool = _f(
        False,
        "with --tp: the blocks' norms, residuals and dropout on 1 / TP of the sequence each "
        "(--seq-len divisible by TP)",
    )
    memory_budget: str | None = _f(
        None,
        "bytes per process (e.g. 4GiB; auto = free CUDA memory): ft.fit picks micro-batches, "
        "checkpointing, precision (and --shard) to fit; rows per step stay",
        metavar="SIZE",
    )
    # -- where it runs (ftrain.app.recipes.placement)
    # ------------------------------------------------
    device: str = _f(
        "auto",
        "auto (the GPU when there is one; under torchrun each process its LOCAL_RANK GPU), cpu, "
        "cuda or cuda:N",
        metavar="DEVICE",
    )
    tf32: bool = _f(True, "TF32 matmuls for fp32 work on GPUs that have them (never on the CPU)")
    # -- LoRA (ft.lora): train low-rank adapters, the model's own params frozen ---------------------
    lora_rank: int = _f(0, "LoRA adapters of this rank on --lora-targets (0 = train every param)")
    lora_alpha: float = _f(16.0, "LoRA scale numerator: the update is alpha / rank * B @ A")
    lora_targets: str = _f(
        "all-linear",
        "comma-separated module-name patterns of the layers LoRA adapts (e.g. attn.qkv,attn.proj)",
        metavar="NAMES",
    )
    # -- optimizer ------------------------------------------------------------------------------
    optimizer: str = _f("adamw", "optimizer (ftrain.optim alias)")
    lr: float = _f(3e-3, "peak learning rate (with --resume: the new peak from the next step)")
    lr_schedule: str = _f("cosine", "learning-rate schedule", choices=SCHEDULES)
    warmup: int = _f(50, "warmup steps")
    decay_steps: int | None = _f(
        None, "length of the schedule (default: max_steps); set it to stop early and resume later"
    )
    weight_decay: float = _f(0.1, "weight decay (matrices only; not biases or norms)")
    clip_grad: float = _f(1.0, "clip the global gradient norm to this (0 = off)")
    # -- data -----------------------------------------------------------------------------------
    data_dir: str | None = _f(
        None, "token cache (default: $FTRAIN_CACHE or ~/.cache/ftrain)/stdlib", metavar="DIR"
    )
    num_workers: int = _f(0, "loader worker threads")
    data: str | None = _f(
        None,
        "train on this: a text file, a folder of them, .jsonl (text, or chat messages: loss on "
        "the assistant's tokens) or .parquet (default: the Python standard library)",
        metavar="PATH",
    )
    pack: bool = _f(
        False, "keep attention within each document of a row and restart positions at each"
    )
    # -- validation and the run's length (ftrain.data.plan_split) -------------------------------
    eval_data: str | None = _f(
        None, "validate on this (formats as --data); all of --data then trains", metavar="PATH"
    )
    val_fraction: float | None = _f(
        None,
        "validate on this fraction of --data: its last documents, or its last tokens when there "
        "are too few documents (0 = no validation; default: 0.03 of the documents, validation off "
        "with a warning when that is less than one row)",
        metavar="F",
    )
    epochs: int | None = _f(
        None,
        "train for this many passes over the training rows instead of --max-steps (the schedule "
        "follows; the run then records the steps it computed as max_steps)",
        metavar="N",
    )
    # -- logging, evaluation, checkpoints --------------------------------------------------------
    log: str = _f(
        "jsonl", "metrics sink besides metrics.jsonl: tensorboard event files", choices=SINK_NAMES
    )
    log_every: int = _f(10, "steps between metrics.jsonl lines (each is one host sync)")
    eval_every: int = _f(100, "steps between validation losses (0 = off)")
    eval_batches: int = _f(8, "validation batches per evaluation")
    save_every: int = _f(200, "steps between checkpoints (0 = only at the end)")
    keep: int = _f(3, "checkpoints to keep")
    sample_tokens: int = _f(
        200, "tokens to generate at the end (bytes for the built-in byte-level GPT; 0 = none)"
    )
    progress: bool = _f(True, "show a progress bar")
    # -- fine-tuning: chat data and the --model-dir model (ftrain.data.chat, ftrain.models.hf) ---
    chat_roles: str | None = _f(
        None,
        "rename your chat data's roles onto system/user/assistant/tool (e.g. human=user,"
        "gpt=assistant); data with no assistant message to learn is refused",
        metavar="NAME=ROLE,...",
    )
    chat_template: str | None = _f(
        None,
        "how chats are rendered: model (the --model-dir's template), builtin (ftrain's <|user|> "
        "template) or a Jinja FILE (default: the model's; builtin for the built-in GPT)",
        metavar="model|builtin|FILE",
    )
    attn_implementation: str | None = _f(
        None,
        "attention kernel of a --model-dir model: sdpa, eager or flash_attention_2 (where "
        "installed) (default: transformers' choice)",
        metavar="NAME",
    )

    # -- kernels: recorded resolved in config.json and every checkpoint, reused on --resume ------
    matmul: str = _f(
        "auto",
        "the built-in GPT's linear kernel: auto (the faster of the two on this CPU for this "
        "model's shapes, timed once; torch on a GPU), onednn or torch; the two agree only to "
        "float32 rounding, so a resumed run keeps the one it recorded",
        choices=MATMULS,
    )

    def validate(self) -> None:
        """Raise ``ValueError`` naming the setting and the legal values for any bad one."""
        positive = (
            "max_steps",
            "seq_len",
            "d_model",
            "n_layer",
            "n_head",
            "batch_size",
            "micro_batches",
            "log_every",
            "eval_batches",
            "keep",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{flag_name(name)} must be >= 1, got {getattr(self, name)}")
        for name in (
            "eval_every",
            "save_every",
            "warmup",
            "sample_tokens",
            "num_workers",
            "n_experts",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"--{flag_name(name)} must be >= 0, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"--d-model ({self.d_model}) must be divisible by --n-head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.lora_rank < 0 or self.lora_alpha <= 0:
            raise ValueError("--lora-rank must be >= 0 (0 = off) and --lora-alpha > 0")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        for name, value in self.to_dict().items():  # beyond int64 (a step counter) or not finite
            if isinstance(value, int | float) and not abs(value) < 2**62:
                raise ValueError(f"--{flag_name(name)} {value} is out of range")
        if self.weight_decay < 0 or self.clip_grad < 0:
            raise ValueError("--weight-decay and --clip-grad must be >= 0")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"--top-k must be in [1, --n-experts], got {self.top_k}")
        for f in dataclasses.fields(self):  # every setting with a fixed set of values
            legal = f.metadata.get("choices")
            if legal is not None and getattr(self, f.name) not in legal:
                raise ValueError(
                    f"--{flag_name(f.name)} must be one of {legal}, got {getattr(self, f.name)!r}"
                )
        self._check_device()
        if self.memory_budget not in (None, "auto"):
            from ftrain.memory import parse_bytes

            parse_bytes(self.memory_budget, "--memory-budget")
        from ftrain.app.model_parallel import check_pp, check_tp

        check_tp(self)
        check_pp(self)
        if self.sequence_parallel and (self.tp == 1 or self.seq_len % self.tp):
            raise ValueError(
                f"--sequence-parallel splits the sequence over the --tp processes: it needs "
                f"--tp > 1 dividing --seq-len (got --tp {self.tp}, --seq-len {self.seq_len})"
            )
        if self.compile and self.shard == "fsdp":
            raise ValueError(
                "--compile cannot be combined with --shard fsdp (torch.compile cannot trace fsdp's "
                "per-block gathering of the params); use --shard zero2 with --compile, or drop "
                "--compile"
            )
        if self.data is not None and not Path(self.data).exists():
            raise ValueError(
                f"--data {self.data!r} does not exist; pass a text file, a folder of them, a "
                ".jsonl or a .parquet file"
            )
        if self.model_dir is not None and not Path(self.model_dir).is_dir():
            raise ValueError(
                f"--model-dir {self.model_dir!r} is not a directory; pass the folder that "
                "model.save_pretrained(folder) and tokenizer.save_pretrained(folder) wrote"
            )
        if self.sequence_parallel and self.model_dir is not None:
            kind = _model_type(self.model_dir)
            if kind != "gpt2":
                raise ValueError(
                    f"--sequence-parallel runs ftrain's GPT or a Hugging Face GPT-2; --model-dir "
                    f"holds model_type {kind!r} (Llama's attention reshapes by its input's "
                    "length, so its blocks cannot run on sequence slices). Drop "
                    "--sequence-parallel (--tp alone works)."
                )
        from ftrain.data.splits import check_settings

        check_settings(self.epochs, self.max_steps != DEFAULT_MAX_STEPS, self.max_steps,
                       self.val_fraction, self.eval_data)  # fmt: skip
        from ftrain.data.chat import parse_chat_roles
        from ftrain.models.hf import check_attn_implementation

        parse_chat_roles(self.chat_roles)  # fine-tuning settings: errors name their flag
        check_attn_implementation(self.attn_implementation, self.model_dir)
        from ftrain.optim import OPTIMIZERS

        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"--optimizer must be one of {sorted(OPTIMIZERS)}, got {self.optimizer!r}"
            )

    def _check_device(self) -> None:
        """``--device`` exists here (``placement.resolve_device``'s one-line error otherwise);
        ``--memory-budget auto`` needs a GPU to read."""
        from ftrain.app.recipes.placement import resolve_device

        device = resolve_device(self.device)
        if self.memory_budget == "auto" and device.type != "cuda":
            raise ValueError(
                f"--memory-budget auto reads the free memory of the GPU the run trains on, and "
                f"this run trains on the CPU (--device {self.device}); give a size, e.g. "
                "--memory-budget 4GiB"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _model_type(model_dir: str) -> str | None:
    """The ``model_type`` in ``model_dir``'s ``config.json`` (None if it has none)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


def _base_type(t) -> type:
    """``int`` for ``int`` and ``int | None``."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if args else t


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`TrainConfig` field. Defaults are left unset (``SUPPRESS``) so that a
    config file's values apply unless a flag is given."""
    for f in dataclasses.fields(TrainConfig):
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        default = f.default
        kw: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": f.name}
        typ = _base_type(_HINTS[f.name])
        if typ is bool:
            kw["action"] = argparse.BooleanOptionalAction
            kw["help"] = f"{help_text} (default: {'on' if default else 'off'})"
        else:
            kw["type"] = typ
            kw["help"] = f"{help_text} (default: {default})"
            kw.update(meta)
        parser.add_argument(f"--{flag_name(f.name)}", **kw)


def load_settings(path: str | Path) -> dict[str, Any]:
    """The settings in a config file: TOML, or JSON (by the ``.json`` suffix or a ``{`` first),
    such as a run's ``config.json``. Flat keys, as the fields are named (dashes allowed).

    **Invariant:** every problem (no such file, a file that does not parse, an unknown key, a
    value of the wrong type) is one ``ValueError`` line that starts with ``--config PATH:``
    (``ftrain.app.settings_file.read_settings``). In a JSON file ``null`` is an unset optional
    setting and a run's record of the file it was given (``config``) is skipped; a run's
    resolved ``device`` and ``precision`` are re-resolved here (:func:`rehome`), so a GPU run's
    config.json also configures a CPU run.
    """
    fields = {name: hint for name, hint in _HINTS.items() if name != "config"}
    raw, is_json = read_settings(path, fields, skip=("config",))
    return rehome(raw) if is_json else raw


def load_toml(path: str | Path) -> dict[str, Any]:
    """:func:`load_settings` (kept for its old name; it reads JSON too)."""
    return load_settings(path)


def from_args(ns: argparse.Namespace) -> TrainConfig:
    """The settings of ``ftrain train``: defaults, then with ``--resume`` the run's saved ones
    (``ftrain.app.run_settings.resumed_values``: the model, data, LoRA and packing cannot change),
    then the ``--config`` file, then the flags given (argparse leaves the others unset); validated.

    Raises ``ValueError`` (one line, naming the flag and the fix) for a bad setting, a
    ``--warmup`` flag that covers every step, or a fixed setting changed on ``--resume``:
    all before any data or model is built.
    """
    given = {k: v for k, v in vars(ns).items() if k in _FIELDS}
    top = {**(load_settings(given["config"]) if given.get("config") else {}), **given}
    values = top
    if top.get("resume") and not top.get("out"):
        raise ValueError("--resume continues the run in --out: pass --out RUN, its folder")
    if top.get("resume"):
        values = resumed_values(top["out"], top, _HINTS)
    cfg = TrainConfig(**values)
    cfg.validate()
    # the steps the schedule plans for: --decay-steps when a run is to stop early and resume
    steps, flag = (
        (cfg.decay_steps, "decay-steps") if cfg.decay_steps else (cfg.max_steps, "max-steps")
    )
    if cfg.warmup and cfg.warmup >= steps and "warmup" not in given:  # the default's, or a file's
        print(f"ftrain train: warning: --warmup {cfg.warmup} >= --{flag} {steps}: the whole run "
              f"is warmup; pass e.g. --warmup {steps // 10}", file=sys.stderr)  # fmt: skip
    if "warmup" in given and cfg.warmup and cfg.warmup >= steps:  # typed (a file's: recorded)
        raise ValueError(
            f"--warmup {cfg.warmup} >= --{flag} {steps}: the whole run would be warmup (the "
            f"learning rate never reaches --lr {cfg.lr:g}); pass a --warmup below --{flag} "
            f"(e.g. --warmup {steps // 10}) or a larger --{flag}"
        )
    return cfg
