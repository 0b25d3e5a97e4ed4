"""Mixture-of-experts feed-forward (:class:`MoE`): each token goes to its top-k of E expert MLPs.

It replaces the dense MLP of a GPT block when ``GPTConfig.n_experts > 0``: more parameters for the
same FLOPs per token. Routing is dropless and per token, so the layer stays causal; the expert
matmuls are one custom op (:func:`expert_mm`) so that a compiled step traces the layer as one
graph whatever the routing.

References:
  1) Switch Transformer: Fedus et al. 2021, https://arxiv.org/abs/2101.03961
  2) Mixtral of Experts: Jiang et al. 2024, https://arxiv.org/abs/2401.04088
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

__all__ = ["MoE", "MoEConfig", "expert_mm", "expert_mm_wgrad"]


class MoEConfig(Protocol):
    """What :class:`MoE` reads from its config: ``ftrain.models.GPTConfig`` has all of it (this
    module does not import gpt.py, which imports it)."""

    n_experts: int
    top_k: int
    d_model: int
    bias: bool
    dropout: float

    @property
    def ff_dim(self) -> int: ...

    def make_linear(self, d_in: int, d_out: int, *, bias: bool) -> nn.Linear: ...


# --- expert matmul as an opaque custom op --------------------------------------------------------
# Each expert multiplies its own contiguous slice of the expert-sorted rows. The slice sizes are
# data (they change every step), so written in Python the loop needs ``counts.tolist()``: a graph
# break under torch.compile and a new graph (or dynamic-shape churn) for each routing. Wrapped as a
# custom op, dynamo and inductor see one call with a static output shape (rows, h) and never look
# at the sizes; the loop runs eagerly inside, also in a compiled step. (F.grouped_mm does the same
# in one kernel, but its fake-tensor kernel accepts bfloat16 only, and on the CPU it is slower.)


@torch.library.custom_op("ftrain::expert_mm", mutates_args=())
def expert_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (M, d) grouped by expert, ``counts[e]`` rows for expert e, times that
    expert's ``w[e]``: (M, d) @ (E, d, h) -> (M, h). ``x`` and ``w`` must have the same dtype."""
    out = x.new_empty(x.shape[0], w.shape[-1])
    # counts.tolist(): a host sync on an accelerator, once per call. Each product goes straight into
    # its rows of ``out`` (a torch.cat of the pieces costs as much again as the matmuls' overhead).
    sizes = counts.tolist()
    for e, (xe, oe) in enumerate(zip(x.split(sizes), out.split(sizes))):
        torch.mm(xe, w[e], out=oe)
    return out


@expert_mm.register_fake
def _(x, w, counts):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("ftrain::expert_mm_wgrad", mutates_args=())
def expert_mm_wgrad(x: torch.Tensor, grad: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`expert_mm` with respect to ``w``: (M, d), (M, h) -> (E, d, h); an
    expert with no rows gets zeros."""
    sizes = counts.tolist()
    out = x.new_empty(counts.shape[0], x.shape[1], grad.shape[1])
    for xe, ge, oe in zip(x.split(sizes), grad.split(sizes), out.unbind(0)):
        torch.mm(xe.T, ge, out=oe)  # (d, 0) @ (0, h) is zeros
    return out


@expert_mm_wgrad.register_fake
def _(x, grad, counts):
    return x.new_empty(counts.shape[0], x.shape[1], grad.shape[1])


def _expert_mm_setup(ctx, inputs, output):
    x, w, counts = inputs
    ctx.save_for_backward(x, w, counts)


def _expert_mm_backward(ctx, grad):
    x, w, counts = ctx.saved_tensors
    need_x, need_w, _ = ctx.needs_input_grad
    gx = expert_mm(grad, w.transpose(1, 2), counts) if need_x else None
    gw = expert_mm_wgrad(x, grad, counts) if need_w else None
    return gx, gw, None


expert_mm.register_autograd(_expert_mm_backward, setup_context=_expert_mm_setup)


class MoE(nn.Module):
    """Mixture-of-experts feed-forward: each token goes to its top-k of ``n_experts`` MLPs.

    A linear router gives each token a softmax over experts; the token is sent to its ``top_k``
    most probable experts and their outputs are summed, weighted by gates. With ``top_k > 1`` the
    gates are the chosen probabilities renormalized to sum to 1 (Mixtral). With ``top_k == 1`` the
    gate is the raw probability (Switch Transformer): renormalizing would make it exactly 1 and cut
    the router off from the language-model gradient. The router's softmax runs in float32, also
    under autocast.

    Dropless: every token is processed (no capacity limit), so the output of a token depends on
    that token only and the layer is causal. Expert weights are batched parameters
    ``w1: (E, d, d_ff)``, ``w2: (E, d_ff, d)``; tokens are sorted by expert so each expert runs one
    matmul on a contiguous slice. In eager mode that is a Python loop over the slices; under
    ``torch.compile`` (e.g. ``ft.compile(step)``) the per-expert matmuls are one custom op,
    :func:`expert_mm`, so the layer traces into the graph with static shapes: no graph break and no
    recompile when the routing changes. Both read the per-expert counts on the host, a device sync
    once per layer (per matmul for the op) on an accelerator.

    Guarantees: with ``n_experts=1`` it computes exactly the dense ``ftrain.models.MLP`` with
    ``w1[0] = fc.weight.T``, ``w2[0] = proj.weight.T`` (and the biases). ``forward`` returns
    ``(y, balance)`` where ``balance = E * sum_i f_i * P_i`` is the Switch load-balancing loss
    (f_i: fraction of token-to-expert assignments that went to expert i, P_i: mean router
    probability of expert i); it is 1.0 when routing is perfectly balanced, E when it is collapsed
    onto one expert, and its gradient reaches the router through P.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        E, d, h = config.n_experts, config.d_model, config.ff_dim
        self.n_experts, self.top_k = E, config.top_k
        self.router = config.make_linear(
            d, E, bias=False
        )  # the model's linear, see GPTConfig.matmul
        self.w1 = nn.Parameter(torch.empty(E, d, h))
        self.b1 = nn.Parameter(torch.zeros(E, h)) if config.bias else None
        self.w2 = nn.Parameter(torch.empty(E, h, d))
        self.b2 = nn.Parameter(torch.zeros(E, d)) if config.bias else None
        self.drop = nn.Dropout(config.dropout)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Router and expert weights ``normal(0, 0.02)``, biases zero (GPT then rescales ``w2``)."""
        for w in (self.router.weight, self.w1, self.w2):
            nn.init.normal_(w, 0.0, 0.02)
        for b in (self.b1, self.b2):
            if b is not None:
                nn.init.zeros_(b)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route N tokens (N, d): returns probs (N, E), gates (N, k) and chosen experts (N, k)."""
        # softmax in float32 even under autocast: low-precision routing is unstable (Switch, sec. 2.4)
        probs = F.softmax(self.router(x).float(), dim=-1)  # (N, E)
        gates, experts = probs.topk(self.top_k, dim=-1)  # (N, k), (N, k)
        if self.top_k > 1:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return probs, gates, experts

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's MLP on its tokens: (n, d) -> (n, d)."""
        h = x @ self.w1[e]  # (n, d_ff)
        if self.b1 is not None:
            h = h + self.b1[e]
        y = F.gelu(h) @ self.w2[e]  # (n, d)
        if self.b2 is not None:
            y = y + self.b2[e]
        return y

    def experts(
        self, xs: torch.Tensor, counts: torch.Tensor, fused: bool | None = None
    ) -> torch.Tensor:
        """Every expert's MLP on its slice of the expert-sorted rows ``xs`` (M, d) -> (M, d), with
        ``counts[e]`` rows for expert e: the same math as :meth:`expert` on each slice.

        Two paths: a Python loop over :meth:`expert` (eager; a few percent faster there) and the
        :func:`expert_mm` custom op (``fused``; the default under ``torch.compile``, where the loop
        would be a graph break)."""
        if fused is None:
            fused = torch.compiler.is_compiling()
        if not fused:
            chunks = xs.split(counts.tolist())  # a host-device sync on an accelerator
            return torch.cat([self.expert(e, chunk) for e, chunk in enumerate(chunks)])
        # Under autocast the matmuls run in the autocast dtype, as ``x @ w`` does in the loop; the
        # custom op is not autocast-aware, so cast here. Biases are added outside the op, per row,
        # with the loop's type promotion (a bf16 product plus an fp32 bias is fp32).
        dev = xs.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else xs.dtype
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.n_experts, device=xs.device), counts, output_size=xs.shape[0]
        )  # (M,)
        h = expert_mm(xs.to(dtype), self.w1.to(dtype), counts)  # (M, d_ff)
        if self.b1 is not None:
            h = h + self.b1[expert_of_row]
        y = expert_mm(F.gelu(h).to(dtype), self.w2.to(dtype), counts)  # (M, d)
        if self.b2 is not None:
            y = y + self.b2[expert_of_row]
        return y

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, d) -> ((B, T, d), 0-d load-balancing loss)."""
        B = x.shape[0]
        x = rearrange(x, "b t d -> (b t) d")  # (N, d), N = B * T tokens
        probs, gates, experts = self.route(x)

        # Sort the N * k (token, expert) assignments by expert: each expert gets a contiguous slice.
        flat = experts.flatten()  # (N * k,) in (token, slot) order
        order = torch.argsort(flat, stable=True)  # (N * k,)
        # assignments per expert (E,): bincount's shape depends on the data, this one does not
        counts = flat.new_zeros(self.n_experts).scatter_add_(0, flat, torch.ones_like(flat))
        xs = x[order // self.top_k]  # (N * k, d): token of each assignment, grouped by expert
        ys = self.experts(xs, counts)  # (N * k, d)
        ys = ys[torch.argsort(order)]  # (N * k, d): back in (token, slot) order; no scatter-add
        ys = rearrange(ys, "(n k) d -> n k d", k=self.top_k)  # (N, k, d)
        y = (ys * gates.unsqueeze(-1).to(ys.dtype)).sum(dim=1)  # (N, d): gate-weighted sum
        y = rearrange(self.drop(y), "(b t) d -> b t d", b=B)  # (B, T, d)

        # Switch Transformer load balancing: E * sum_i f_i * P_i (f has no gradient, P does).
        f = counts.to(probs.dtype) / flat.numel()  # (E,)
        P = probs.mean(dim=0)  # (E,)
        balance = self.n_experts * (f * P).sum()
        return y, balance
