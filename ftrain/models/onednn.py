"""``linear`` and ``Linear``: ``F.linear`` / ``nn.Linear`` whose CPU float32 matmuls run in oneDNN.

PyTorch sends a float32 matmul on the CPU to its BLAS (MKL in the x86 wheels). On AMD processors
MKL takes a slow path: on the Zen 5 machine of ``benchmarks/RESULTS.md`` a 2048-square float32
matmul runs at about 190 GFLOP/s through ``torch.mm`` and about 430 GFLOP/s through oneDNN, which
ships inside the same wheel (``torch.ops.mkldnn._linear_pointwise``, the kernel inductor uses for
frozen CPU inference). Here the forward and both gradients of a linear layer go to oneDNN:

    >>> import torch
    >>> from ftrain.models import linear
    >>> x, w = torch.randn(8, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    >>> torch.allclose(linear(x, w), torch.nn.functional.linear(x, w))
    True

The result is float32 matmul math in another summation order: it agrees with ``F.linear`` to
float32 rounding (about 1e-6 relative), not bit for bit. Everything else (a GPU, other dtypes,
``torch.autocast`` on the CPU, tensor subclasses such as DTensor, ``torch.backends.mkldnn``
switched off with ``torch.backends.mkldnn.flags(enabled=False)``, a machine that is not x86)
takes ``F.linear`` unchanged. ``GPTConfig.matmul`` chooses between this layer and ``nn.Linear``.

Which one is faster depends on the processor: oneDNN wins on that Zen 5 machine, MKL on Intel
Xeons (1.1-1.2x faster there) and, at small sizes, on Zen 4. :func:`faster_linear` times both on a
model's own shapes and says which; its answers are kept in a small JSON file keyed by processor,
torch version, threads and shapes (:func:`kernel_cache_path`), so a machine times a model once.

This module is the adapter to two private torch APIs, used nowhere else in ftrain:
``torch.ops.mkldnn._linear_pointwise`` (the oneDNN kernel) and
``torch._C._functorch.is_functorch_wrapped_tensor`` (see ``_functorch_wrapped``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ftrain.internals import func_scope

__all__ = [
    "linear",
    "Linear",
    "onednn_linear_available",
    "faster_linear",
    "time_linears",
    "kernel_cache_path",
    "KERNELS",
    "MATMUL_OPS",
    "MIN_MACS",
    "MIN_MACS_WEIGHT_GRAD",
]


def onednn_linear_available() -> bool:
    """Whether this torch build has the oneDNN linear kernel and this is an x86 machine (elsewhere
    ``linear`` is ``F.linear``). Whether it is also the faster one here, :func:`faster_linear`
    measures."""
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


_AVAILABLE = onednn_linear_available()

# oneDNN costs about 10 us a call more than MKL: below these sizes (m * n * k multiply-adds) MKL is
# as fast or faster. The weight gradient reads both operands transposed, which oneDNN handles less
# well, so it needs a larger product to win (measured on the machine of benchmarks/RESULTS.md).
MIN_MACS = 1 << 20
MIN_MACS_WEIGHT_GRAD = 1 << 23


def _linear_pointwise(
    a: torch.Tensor, b_t: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # Private torch API: oneDNN's linear, which inductor calls for frozen CPU inference. No public
    # API sends a float32 CPU matmul to oneDNN; were F.linear to dispatch such matmuls there, this
    # call (and the module) would be F.linear itself.
    return torch.ops.mkldnn._linear_pointwise(a, b_t, bias, "none", [], "")


@torch.library.custom_op("ftrain::onednn_linear", mutates_args=())
def _onednn_linear_op(
    a: torch.Tensor, b_t: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``a @ b_t.T (+ bias)`` in oneDNN, as one opaque op: what a compiled graph calls (inductor's
    own lowering of the oneDNN kernel accepts only frozen weights)."""
    return _linear_pointwise(a, b_t, bias)


@_onednn_linear_op.register_fake
def _(a, b_t, bias):
    return a.new_empty(*a.shape[:-1], b_t.shape[0])


#: The torch ops that ``linear`` runs its matmuls as on the oneDNN path: the kernel itself (eager)
#: and the ``ftrain::onednn_linear`` custom op (under torch.compile). Activation checkpointing's
#: "selective" policy saves these outputs as it does ``aten.mm``'s; on the F.linear path (and with
#: ``GPTConfig(matmul="torch")``) the matmuls are ordinary aten ops and none of these appear.
MATMUL_OPS = tuple(
    op
    for op in (
        getattr(getattr(torch.ops.mkldnn, "_linear_pointwise", None), "default", None),
        torch.ops.ftrain.onednn_linear.default,
    )
    if op is not None
)


def _mm(a: torch.Tensor, b_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b_t.T (+ bias)`` in oneDNN; ``a`` (..., k), ``b_t`` (n, k), any strides."""
    if torch.compiler.is_compiling():
        return _onednn_linear_op(a, b_t, bias)
    return _linear_pointwise(a, b_t, bias)


class _OneDNNLinear(torch.autograd.Function):
    """``x @ w.T + b`` with the forward and the input gradient in oneDNN, and the weight gradient
    too when it is large enough."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return _mm(x, w, b)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, w, b = inputs
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        n_out, n_in = w.shape
        dy2 = dy.reshape(-1, n_out)  # (N, out)
        dx = dw = db = None
        if need_x:
            dx = _mm(dy, w.t())  # (..., in) = dy @ w
        if need_w:
            x2 = x.reshape(-1, n_in)  # (N, in)
            if dy2.shape[0] * n_out * n_in < MIN_MACS_WEIGHT_GRAD:
                dw = dy2.t() @ x2
            elif n_out >= n_in:  # the kernel copies its first operand to contiguous: the narrower
                dw = _mm(x2.t(), dy2.t()).t().contiguous()  # (in, out) -> (out, in)
            else:
                dw = _mm(dy2.t(), x2.t())  # (out, in) = dy.T @ x
        if ctx.has_bias and need_b:
            db = dy2.sum(0)
        return dx, dw, db


_PLAIN = (torch.Tensor, nn.Parameter)


def _use_onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    return (
        _AVAILABLE
        and torch.backends.mkldnn.enabled
        and type(x) in _PLAIN
        and type(w) in _PLAIN
        and (b is None or type(b) in _PLAIN)
        and x.device.type == "cpu"
        and x.dtype == w.dtype == torch.float32
        and (b is None or b.dtype == torch.float32)
        and x.dim() >= 1
        and x.numel() // max(x.shape[-1], 1) * w.shape[0] * w.shape[1] >= MIN_MACS
        and not torch.is_autocast_enabled("cpu")
        and not _functorch_wrapped(x, w, b)
    )


def _functorch_wrapped(*tensors: torch.Tensor | None) -> bool:
    """Under torch.func transforms (vmap over the inputs or over the weights, grad) tensors are
    wrappers the oneDNN kernel cannot take; those calls keep F.linear."""
    if torch.compiler.is_compiling():  # the query below is not traceable: ask ftrain's flag
        return func_scope.inside()
    # Private torch API: there is no public "is this a torch.func wrapper" query. A public route
    # would be a vmap rule for the oneDNN op (torch.library.register_vmap), with no need to ask.
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return any(t is not None and wrapped(t) for t in tensors)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x @ weight.T + bias``, differentiable in all three.

    On an x86 CPU with float32 tensors (and no CPU autocast), when the product is large enough to
    pay for oneDNN's call overhead (``MIN_MACS``), the matmuls of a training step (forward,
    ``dx = dy @ W`` and, when large enough, ``dW = dy.T @ x``) run in oneDNN (about 2x MKL's speed
    on a Zen 5 processor, slower than MKL on Intel Xeons: :func:`faster_linear` measures which);
    the bias gradient is a sum. Otherwise it is ``F.linear``. Second
    derivatives are not supported on the oneDNN path (``create_graph=True`` through it raises).
    Under ``torch.compile`` the oneDNN calls are one custom op, ``ftrain::onednn_linear``.
    """
    if _use_onednn(x, weight, bias):
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` computed with :func:`linear`: the same parameters, init and ``state_dict``
    (a drop-in replacement, also for checkpoints of ``nn.Linear``), faster CPU float32 matmuls."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# --- which kernel is faster on this machine -------------------------------------------------------

#: The answers of :func:`faster_linear`: the oneDNN path of :func:`linear`, or torch's ``F.linear``.
KERNELS = ("onednn", "torch")

# oneDNN is taken only where it needs under this fraction of torch's time: a tie, or a gain within
# the timing noise of a loaded machine, keeps torch's own kernel (and its summation order).
MARGIN = 0.95
# A model whose oneDNN-sized products come to fewer multiply-adds per forward than this (about a
# millisecond of a step's matmuls on 2 cores) keeps torch's own kernel untimed: what either kernel
# could gain there is below what a timing on a busy machine resolves, and below a step's overhead.
MIN_TIMED_MACS = 1 << 24
# Multiply-adds one timed pass over a model's shapes may cost: about 0.1 s on 2 cores. Larger
# models are timed on fewer rows (never under TIMING_MIN_ROWS), where the ratio is already that of
# their full batch (both kernels are compute-bound there).
TIMING_MACS = 1 << 33
TIMING_MIN_ROWS = 512
TIMING_REPEATS = 4
TIMING_SECONDS = 1.0  # passes continue for this long: more chances of an undisturbed run of each


def time_linears(
    shapes: Sequence[tuple[int, int, int]],
    rows: int,
    *,
    repeats: int = TIMING_REPEATS,
    seconds: float = TIMING_SECONDS,
) -> dict[str, float]:
    """Seconds that one forward and backward (``dx`` and ``dW``) of every linear in ``shapes``
    take with each kernel of ``KERNELS`` on ``rows`` rows of float32 on the CPU.

    ``shapes``: ``(d_in, d_out, count)`` per distinct layer shape, ``count`` the layers of that
    shape (each shape is timed once and its time counted ``count`` times).

    **Invariant:** the kernels are timed interleaved, in alternating order, after one warm-up
    pass: at least ``repeats`` passes, more while the passes so far took under ``seconds`` (at
    most 100). Each shape's time is its best over the passes (the run least disturbed by other
    work on the machine); with one torch thread, CPU time of this thread, else wall time. Nothing outside the call changes: its inputs come from a private
    generator, so the global random state is untouched.
    """
    g = torch.Generator().manual_seed(0)
    kernels = {"onednn": linear, "torch": F.linear}
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False):
        cases = [
            (
                count,
                torch.randn(rows, d_in, generator=g, device="cpu", requires_grad=True),  # x
                torch.randn(d_out, d_in, generator=g, device="cpu", requires_grad=True),  # W
                torch.randn(rows, d_out, generator=g, device="cpu"),  # dy
            )
            for d_in, d_out, count in shapes
        ]
        # one torch thread computes in this thread: its CPU time, which waiting for a core (on a
        # busy machine) does not inflate. Several: wall time, what the run will see.
        clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
        best = {name: [math.inf] * len(cases) for name in kernels}
        start = time.perf_counter()
        rep = 0
        while rep <= repeats or (time.perf_counter() - start < seconds and rep <= 100):
            for name in list(kernels) if rep % 2 else list(reversed(kernels)):
                for i, (_, x, w, dy) in enumerate(cases):
                    t = clock()
                    torch.autograd.grad(kernels[name](x, w), (x, w), dy)
                    if rep > 0:  # pass 0 warms up: oneDNN builds its primitives there
                        best[name][i] = min(best[name][i], clock() - t)
            rep += 1
    return {name: sum(c[0] * t for c, t in zip(cases, times)) for name, times in best.items()}


def kernel_cache_path() -> Path:
    """The JSON file that keeps :func:`faster_linear`'s answers: ``$FTRAIN_CACHE_DIR`` (else
    ``$XDG_CACHE_HOME/ftrain``, else ``~/.cache/ftrain``) ``/kernels.json``. Delete it to time
    again (e.g. after a measurement on a busy machine)."""
    root = os.environ.get("FTRAIN_CACHE_DIR")
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "ftrain")
    return Path(root) / "kernels.json"


def faster_linear(
    shapes: Sequence[tuple[int, int, int]],
    rows: int,
    *,
    cache: str | os.PathLike | None = "default",
) -> str:
    """Which kernel of ``KERNELS`` runs a model's linears faster on this machine: ``"onednn"``
    (:func:`linear`) or ``"torch"`` (``F.linear``), for ``rows`` rows (batch * sequence length)
    of float32 on the CPU. ``shapes`` as in :func:`time_linears`.

    ``"torch"`` without timing where the oneDNN path would not run: no oneDNN kernel or not x86
    (``onednn_linear_available``), oneDNN switched off (``torch.backends.mkldnn.flags``), a
    default device that is not the CPU (a GPU or ``meta``: there both are ``F.linear``), fake
    tensors (a model built under ``FakeTensorMode`` to be planned, not run), or too
    little work on oneDNN's side to tell (under ``MIN_TIMED_MACS`` multiply-adds per forward in
    products of at least ``MIN_MACS``). Otherwise both are timed (:func:`time_linears`,
    on at most ``TIMING_MACS // macs-per-row`` rows) unless ``cache`` (a JSON file;
    ``"default"``: :func:`kernel_cache_path`; None: none) already holds the answer for this
    processor, torch version, number of threads, rows and shapes. With several torch threads on
    a machine whose load leaves them no free cores, a timing would measure the scheduler: the
    answer is then ``"torch"``, untimed and not cached (a later build on a quiet machine times).

    **Invariant:** ``"onednn"`` only where it measured under ``MARGIN`` (0.95) of torch's time,
    so the answer is never slower than torch's own beyond timing noise. The two kernels agree to
    float32 rounding (about 1e-6 relative), not bitwise: a run that must continue bit for bit
    (resume) records the answer and forces it (``GPTConfig(matmul=answer)``) rather than asking
    again.
    """
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"faster_linear: rows={rows!r} must be an int >= 1 (batch * seq_len).")
    onednn_macs = sum(c * rows * i * o for i, o, c in shapes if rows * i * o >= MIN_MACS)
    if not (
        _AVAILABLE
        and torch.backends.mkldnn.enabled
        and torch.get_default_device().type == "cpu"
        and type(torch.empty(0)) is torch.Tensor  # not under FakeTensorMode (planning a model)
        and onednn_macs >= MIN_TIMED_MACS
    ):
        return "torch"
    shapes = sorted({(int(i), int(o), int(c)) for i, o, c in shapes})
    rows = min(rows, max(TIMING_MIN_ROWS, TIMING_MACS // (3 * sum(i * o for i, o, _ in shapes))))
    path = kernel_cache_path() if cache == "default" else cache
    key = json.dumps([_processor(), torch.__version__, torch.get_num_threads(), rows, shapes])
    answers = _read_cache(path) if path is not None else {}
    if key in answers and answers[key].get("choice") in KERNELS:
        return answers[key]["choice"]
    if _busy():
        return "torch"  # a timing now would measure the scheduler: keep torch's, cache nothing
    seconds = time_linears(shapes, rows)
    choice = "onednn" if seconds["onednn"] < MARGIN * seconds["torch"] else "torch"
    if path is not None:
        answers[key] = {"choice": choice, **seconds}
        _write_cache(path, answers)
    return choice


def _busy() -> bool:
    """Whether other work holds the cores that several torch threads would time on (the 1-minute
    load average plus our threads above the cores). Then OpenMP's threads wait for each other at
    every parallel region for a whole scheduler slice, and the kernel with fewer regions looks
    twice as fast: on a 2-core AMD EPYC at load 3, oneDNN timed 0.5x torch's where it is 1.2x on
    the quiet machine. One thread is timed by its own CPU time, which such waits do not inflate."""
    threads = torch.get_num_threads()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average (Windows): assume a quiet machine
        return False
    return threads > 1 and load + threads > (os.cpu_count() or 1) + 0.5


def _processor() -> str:
    """The processor's name, family and model (Linux ``/proc/cpuinfo``), else what ``platform``
    knows: the part of the cache key that tells an AMD EPYC from an Intel Xeon."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("model name", "cpu family", "model"):
                    fields.setdefault(name.strip(), value.strip())
                if not line.strip():
                    break  # the first processor's block is enough
    except OSError:
        pass
    return " / ".join(fields.values()) or f"{platform.processor()} {platform.machine()}"


def _read_cache(path: str | os.PathLike) -> dict:
    try:
        with open(path) as f:
            answers = json.load(f)
    except (OSError, ValueError):  # none yet, or damaged: time again and rewrite it
        return {}
    return answers if isinstance(answers, dict) else {}


def _write_cache(path: str | os.PathLike, answers: dict) -> None:
    """Atomically (a temporary file renamed over it), so that processes timing at once never
    leave half a file; a cache that cannot be written is skipped, not an error."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(answers, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError:
        pass
