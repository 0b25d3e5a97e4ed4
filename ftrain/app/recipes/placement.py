"""Where a run trains: ``--device``, ``--precision auto`` and ``--tf32`` resolved, and the line
that says what was picked.

    ftrain train                      # auto: the GPU when there is one, bf16 there; else CPU fp32
    ftrain train --device cpu         # the CPU even on a GPU machine
    torchrun --nproc_per_node 8 -m ftrain train --shard fsdp    # each process its LOCAL_RANK GPU

    from ftrain.app.recipes import placement
    cfg = placement.resolve(cfg)      # cfg.device "cuda:0" or "cpu", cfg.precision "bf16"/"fp32"
    print(placement.describe(cfg, model))

:func:`resolve` is pure and idempotent: a resolved config resolves to itself, so the loop, the
recipes and ``ft.fit``'s planning all see the same choice, and ``config.json`` records it.
This module is also the one place that reads torch's SDPA backend priorities (a private API).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import platform
from typing import Any

import torch

__all__ = [
    "describe",
    "release_params",
    "resolve",
    "resolve_device",
    "resolve_precision",
    "sdpa_backend",
    "tf32_applies",
]

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def _local_rank() -> int | None:
    """torchrun's ``LOCAL_RANK`` when this process is one of several, else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ.get("LOCAL_RANK", "0"))
    return None


def resolve_device(spec: str) -> torch.device:
    """The device ``--device spec`` names on this machine: ``auto`` is ``cuda`` when CUDA is
    available, else ``cpu``; ``cuda`` is GPU 0, or under torchrun this process's ``LOCAL_RANK``
    GPU; ``cuda:N`` is GPU N (one process only). A concrete result resolves to itself.

    **Invariant:** the result exists on this machine; otherwise a ``ValueError`` that starts with
    ``--device <spec>:`` and says what to pass instead (raised before anything is built).
    """
    if not isinstance(spec, str):
        raise ValueError(f"--device {spec!r}: must be a string, one of {DEVICE_CHOICES}")
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    kind, _, index = spec.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"--device {spec}: not a device ftrain trains on; pass {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"--device {spec}: CUDA is not available on this machine (torch "
            f"{torch.__version__}, torch.cuda.is_available() is False); pass --device cpu, or "
            "--device auto to use a GPU only when there is one"
        )
    count = torch.cuda.device_count()
    rank = _local_rank()
    if index and rank is not None:
        raise ValueError(
            f"--device {spec}: under torchrun each process takes its LOCAL_RANK GPU; pass "
            "--device cuda (or auto) and choose the GPUs with CUDA_VISIBLE_DEVICES"
        )
    n = int(index) if index else (rank or 0)
    if n >= count:
        what = f"LOCAL_RANK {n}" if rank is not None else f"GPU {n}"
        raise ValueError(
            f"--device {spec}: {what} asked for, but this machine shows {count} GPU(s) "
            f"(cuda:0 to cuda:{count - 1}); "
            + (
                f"launch at most {count} processes per node (torchrun --nproc_per_node {count})"
                if rank is not None
                else f"pass --device cuda:{count - 1} or less"
            )
        )
    return torch.device("cuda", n)


def resolve_precision(precision: str, device: torch.device) -> str:
    """``--precision``: ``auto`` is ``bf16`` on a GPU that computes in it natively and ``fp32``
    elsewhere (the CPU, older GPUs); the others as given."""
    if precision != "auto":
        return precision
    if device.type == "cuda" and _native_bf16(device):
        return "bf16"
    return "fp32"


def _native_bf16(device: torch.device) -> bool:
    """Whether the GPU ``device`` computes in bf16 natively (what
    ``torch.cuda.is_bf16_supported(including_emulation=False)`` says of the current device):
    Ampere (compute capability 8) or newer; on ROCm, torch's own answer."""
    if torch.version.hip:
        return torch.cuda.is_bf16_supported()
    return torch.cuda.get_device_capability(device)[0] >= 8


def tf32_applies(cfg: Any) -> bool:
    """Whether the step of the resolved ``cfg`` runs with TF32 matmuls (``ft.autocast(tf32=)``,
    scoped to each step): on a CUDA GPU that has TF32 (Ampere, compute capability 8, or newer),
    unless ``--no-tf32``. Never on the CPU."""
    device = torch.device(cfg.device)
    if device.type != "cuda" or not cfg.tf32:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def resolve(cfg: Any) -> Any:
    """``cfg`` (a ``TrainConfig``) with ``device`` and ``precision`` resolved for this machine
    and process (see :func:`resolve_device`, :func:`resolve_precision`); ``cfg`` is not changed.
    **Invariant:** ``resolve(resolve(cfg)) == resolve(cfg)``."""
    device = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, device)
    if cfg.device == str(device) and cfg.precision == precision:
        return cfg
    return dataclasses.replace(cfg, device=str(device), precision=precision)


def release_params(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a recipe's template, once the state holds its params) with each parameter's
    tensor swapped for a ``meta`` tensor of the same shape and dtype; returns ``model``.

    The Parameter objects stay (so tied parameters stay tied) and so do the buffers, on their
    device: ``ft.apply`` runs the template with the state's params and never reads its own, so
    the device holds the params once, not twice (and under fsdp or --tp, each process only its
    pieces, not also a whole copy)."""
    for p in list(model.parameters()):
        placeholder = torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        torch.utils.swap_tensors(p, placeholder)
    return model


# -- what was picked ------------------------------------------------------------------------------
def sdpa_backend(
    device: torch.device, dtype: torch.dtype, head_dim: int, *, dropout: float, masked: bool
) -> str:
    """The kernel ``scaled_dot_product_attention`` takes for a causal attention of ``dtype`` with
    heads of ``head_dim`` on a CUDA ``device`` (``masked``: with an explicit mask, as ``--pack``
    gives), as far as torch's own checks and priority order tell: ``"flash"``, ``"cuDNN"``,
    ``"memory-efficient"`` or ``"math"``. On the CPU: ``"CPU"`` (torch's CPU kernels)."""
    if device.type != "cuda":
        return "CPU"
    from torch.backends import cuda as backends

    names = {1: "flash", 2: "memory-efficient", 3: "cuDNN", 0: "math"}
    checks = {  # (switched on, can run these inputs)
        1: ("flash_sdp_enabled", "can_use_flash_attention"),
        2: ("mem_efficient_sdp_enabled", "can_use_efficient_attention"),
        3: ("cudnn_sdp_enabled", "can_use_cudnn_attention"),
    }
    order_of = getattr(torch._C, "_get_sdp_priority_order", None)  # private: read here only
    order = list(order_of()) if order_of is not None else [1, 2, 0, 3]
    try:  # torch's checks changed across versions: an answer it cannot give is "unknown"
        q = torch.empty(1, 2, 64, head_dim, device=device, dtype=dtype)  # (B, nh, T, hs)
        mask = torch.ones(64, 64, dtype=torch.bool, device=device).tril() if masked else None
        params = backends.SDPAParams(q, q, q, mask, dropout, not masked, False)
        for backend in order:
            if backend == 0 and backends.math_sdp_enabled():
                return "math"
            enabled, usable = (getattr(backends, n, None) for n in checks.get(backend, ("", "")))
            if enabled is not None and usable is not None and enabled() and usable(params, False):
                return names[backend]
    except (TypeError, RuntimeError, AttributeError):
        return "unknown"
    return "math"


def _processor() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown processor"


def describe(cfg: Any) -> str:
    """One line, printed first by ``ftrain train``: the device (its name and memory), the
    precision (and TF32; under autocast, the loss's), the attention kernel, the optimizer's
    update kernel and the matmul kernel of the resolved ``cfg``'s run (the built-in GPT's
    ``cfg.matmul``, as ``gpt.resolve_matmul`` chose it; a ``--model-dir`` model's attention is
    its own)."""
    from ftrain.models.onednn import onednn_linear_available
    from ftrain.optim import OPTIMIZERS

    device = torch.device(cfg.device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = f"{device} ({props.name}, {props.total_memory / 2**30:.0f} GiB)"
    else:
        where = f"cpu ({_processor()}, {torch.get_num_threads()} threads)"
    precision = {"fp32": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast + loss scale"}
    tf32 = ", TF32 matmuls" if tf32_applies(cfg) else ""
    # under autocast, the loss's log-probabilities: fp32 unless --no-loss-fp32
    loss = f", loss {'fp32' if cfg.loss_fp32 else cfg.precision}" if cfg.precision != "fp32" else ""
    if cfg.model_dir is None:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision, torch.float32)
        kernel = sdpa_backend(device, dtype, cfg.d_model // cfg.n_head, dropout=cfg.dropout,
                              masked=cfg.pack)  # fmt: skip
        attention = f"SDPA {kernel}"
        matmul = {"onednn": "oneDNN (ftrain.models.Linear)", "torch": "torch"}.get(
            cfg.matmul, repr(cfg.matmul)
        )
        if cfg.matmul == "onednn" and (device.type != "cpu" or not onednn_linear_available()):
            matmul = "torch (--matmul onednn runs torch's off an x86 CPU)"
    else:
        attention, matmul = "the model's own", "torch"
    options = inspect.signature(OPTIMIZERS[cfg.optimizer]).parameters
    update = "fused where torch has the kernel (fused=None)" if "fused" in options else "foreach"
    return (
        f"ftrain train: device {where}; precision {precision[cfg.precision]}{tf32}{loss}; "
        f"attention {attention}; optimizer {cfg.optimizer} {update}; matmul {matmul}"
    )
