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

This module is the adapter to two private torch APIs, used nowhere else in ftrain:
``torch.ops.mkldnn._linear_pointwise`` (the oneDNN kernel) and
``torch._C._functorch.is_functorch_wrapped_tensor`` (see ``_functorch_wrapped``).
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ftrain import func_scope

__all__ = [
    "linear",
    "Linear",
    "onednn_linear_available",
    "MATMUL_OPS",
    "MIN_MACS",
    "MIN_MACS_WEIGHT_GRAD",
]


def onednn_linear_available() -> bool:
    """Whether this torch build has the oneDNN linear kernel and this is an x86 machine (where it
    is measured to be the faster one; elsewhere ``linear`` is ``F.linear``)."""
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
    ``dx = dy @ W`` and, when large enough, ``dW = dy.T @ x``) run in oneDNN, about 2x faster
    than MKL on AMD processors; the bias gradient is a sum. Otherwise it is ``F.linear``. Second
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
