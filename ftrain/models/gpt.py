"""A GPT language model in one file, in the spirit of nanoGPT.

    >>> import torch
    >>> from ftrain.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2))
    >>> idx = torch.randint(0, 257, (2, 16))
    >>> model(idx).shape  # (B, T, vocab_size)
    torch.Size([2, 16, 257])

The module holds parameters only (no buffers, nothing written to ``self`` during forward), so it
can be used as a stateless template through ``torch.func.functional_call`` / ``ft.apply``.
Mixture-of-experts blocks (``n_experts > 0``) return their load-balancing loss as a value:
``logits, aux = model(idx, return_aux=True)``.

References:
  1) GPT-2: Radford et al. 2019, and karpathy/nanoGPT model.py
  2) Switch Transformer: Fedus et al. 2021, https://arxiv.org/abs/2101.03961
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from ftrain.models.onednn import Linear, linear


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`GPT`. Every field is checked when the config is built."""

    vocab_size: int = 257  # 256 byte values + 1 end-of-document token (id 256)
    seq_len: int = 128  # block size: the longest context, i.e. the rows of the position table
    d_model: int = 128  # width of the residual stream
    n_layer: int = 4  # number of transformer blocks
    n_head: int = 4  # attention heads per block; head size is d_model // n_head
    d_ff: int | None = None  # hidden width of the MLP and of each expert; None: 4 * d_model
    dropout: float = 0.0  # embeddings, attention, residual branches; 0.0 suits short pretraining
    bias: bool = True  # biases in Linears, experts and LayerNorms; False: a bit faster, as good
    tie_weights: bool = True  # lm head reuses wte.weight (saves vocab_size * d_model params)
    n_experts: int = 0  # 0: dense MLP in every block; >= 1: mixture-of-experts with this many
    top_k: int = 1  # experts each token is sent to (MoE only); 1: Switch Transformer, 2: Mixtral
    aux_loss_weight: float = 0.01  # scales the balance loss in aux["moe_aux_loss"]; Switch: 0.01
    norm_eps: float = 1e-5  # LayerNorm epsilon

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layer", "n_head"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.d_ff is not None:
            _check_int("d_ff", self.d_ff, minimum=1, fix="or None for 4 * d_model")
        _check_int("n_experts", self.n_experts, minimum=0, fix="0 means a dense MLP")
        _check_int("top_k", self.top_k, minimum=1)
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must be divisible by n_head={self.n_head} "
                f"(each head gets d_model // n_head channels). Fix: choose n_head among "
                f"{[h for h in range(1, min(self.d_model, 16) + 1) if self.d_model % h == 0]} "
                f"or change d_model."
            )
        if self.n_experts > 0 and self.top_k > self.n_experts:
            raise ValueError(
                f"GPTConfig: top_k={self.top_k} must be <= n_experts={self.n_experts} "
                f"(a token cannot be routed to more experts than exist). "
                f"Fix: top_k={self.n_experts} or n_experts>={self.top_k}."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"GPTConfig: dropout={self.dropout} must be in [0, 1) (a probability of zeroing "
                f"an activation). Fix: e.g. dropout=0.0 or dropout=0.1."
            )
        if not self.aux_loss_weight >= 0.0:
            raise ValueError(
                f"GPTConfig: aux_loss_weight={self.aux_loss_weight} must be >= 0 "
                f"(a negative weight would reward imbalance). Fix: e.g. aux_loss_weight=0.01."
            )
        if not self.norm_eps > 0.0:
            raise ValueError(
                f"GPTConfig: norm_eps={self.norm_eps} must be > 0 (it keeps LayerNorm from "
                f"dividing by zero). Fix: e.g. norm_eps=1e-5."
            )

    @property
    def ff_dim(self) -> int:
        """Hidden width of the MLP / each expert: ``d_ff``, or ``4 * d_model`` when ``d_ff`` is None."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @property
    def head_dim(self) -> int:
        """Channels per attention head: ``d_model // n_head``."""
        return self.d_model // self.n_head


def _check_int(name: str, value: object, *, minimum: int, fix: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"GPTConfig: {name}={value!r} must be an int >= {minimum}"
            + (f" ({fix})." if fix else ".")
        )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: position t attends to positions <= t only."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, d)."""
        # split (not a reshape to (3, ...)): its backward is a single concatenation of dq, dk, dv
        qkv = self.qkv(x).split(x.shape[-1], dim=-1)  # 3 x (B, T, d)
        q, k, v = (rearrange(z, "b t (nh hs) -> b nh t hs", nh=self.n_head) for z in qkv)
        # q, k, v: (B, nh, T, hs). Flash attention on GPU; the causal mask is built inside the kernel.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = rearrange(y, "b nh t hs -> b t (nh hs)")  # (B, T, d): heads side by side again
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """The dense feed-forward: Linear(d, d_ff) -> GELU -> Linear(d_ff, d) -> dropout."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = Linear(config.d_model, config.ff_dim, bias=config.bias)
        self.proj = Linear(config.ff_dim, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., d)."""
        return self.drop(self.proj(F.gelu(self.fc(x))))


# --- expert matmul as an opaque custom op --------------------------------------------------------
# Each expert multiplies its own contiguous slice of the expert-sorted rows. The slice sizes are
# data (they change every step), so written in Python the loop needs ``counts.tolist()``: a graph
# break under torch.compile and a new graph (or dynamic-shape churn) for each routing. Wrapped as a
# custom op, dynamo and inductor see one call with a static output shape (rows, h) and never look
# at the sizes; the loop runs eagerly inside, also in a compiled step. (F.grouped_mm does the same
# in one kernel, but its fake-tensor kernel accepts bfloat16 only, and on CPU it was slower.)


@torch.library.custom_op("ftrain::expert_mm", mutates_args=())
def expert_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (M, d) grouped by expert, ``counts[e]`` rows for expert e, times that
    expert's ``w[e]``: (M, d) @ (E, d, h) -> (M, h). ``x`` and ``w`` must have the same dtype."""
    out = x.new_empty(x.shape[0], w.shape[-1])
    # counts.tolist(): a host sync on an accelerator, once per call. Each product goes straight into
    # its rows of ``out`` (a torch.cat of the pieces cost as much again as the matmuls' overhead).
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

    Guarantees: with ``n_experts=1`` it computes exactly the dense :class:`MLP` with
    ``w1[0] = fc.weight.T``, ``w2[0] = proj.weight.T`` (and the biases). ``forward`` returns
    ``(y, balance)`` where ``balance = E * sum_i f_i * P_i`` is the Switch load-balancing loss
    (f_i: fraction of token-to-expert assignments that went to expert i, P_i: mean router
    probability of expert i); it is 1.0 when routing is perfectly balanced, E when it is collapsed
    onto one expert, and its gradient reaches the router through P.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        E, d, h = config.n_experts, config.d_model, config.ff_dim
        self.n_experts, self.top_k = E, config.top_k
        self.router = Linear(d, E, bias=False)
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


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
        self.mlp = MLP(config) if config.n_experts == 0 else MoE(config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T, d) -> ((B, T, d), this block's MoE balance loss, or None for a dense MLP)."""
        x = x + self.attn(self.ln_1(x))
        if isinstance(self.mlp, MoE):
            y, balance = self.mlp(self.ln_2(x))
        else:
            y, balance = self.mlp(self.ln_2(x)), None
        return x + y, balance


class GPT(nn.Module):
    """A decoder-only transformer language model: token ids (B, T) -> next-token logits.

    Layout: ``wte`` (token embedding), ``wpe`` (learned positions), ``blocks`` (an
    ``nn.ModuleList`` of :class:`Block`; activation checkpointing finds them there), ``ln_f``,
    then the lm head. With ``tie_weights`` the lm head *is* ``wte.weight`` (``linear(x,
    wte.weight)``) and there is no separate ``lm_head`` parameter, so ``named_parameters()`` and
    ``state_dict()`` have the same keys and no tensor is stored twice (safetensors refuses shared
    tensors). Without tying, ``lm_head`` is a ``Linear(d_model, vocab_size, bias=False)``. Every
    Linear is :class:`ftrain.models.Linear` (``nn.Linear`` with oneDNN matmuls for float32 on the
    CPU, see ``ftrain.models.onednn``): same parameters and state_dict keys as ``nn.Linear``.

    Guarantees: the module has no buffers and ``forward`` writes nothing to ``self``, so it is a
    pure function of (parameters, idx) and, in training mode, the random state used by dropout.
    Logits at position t depend on ``idx[:, :t+1]`` only. Init follows GPT-2: weights
    ``normal(0, 0.02)``, residual output projections ``normal(0, 0.02 / sqrt(2 * n_layer))``,
    biases zero.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
        if config.tie_weights:
            self.lm_head = None  # the output projection is wte.weight, see forward
        else:
            self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)initialize every parameter GPT-2 style, drawing from the global torch random state."""
        self.apply(self._init_module)
        for name, p in self.named_parameters():  # projections that write into the residual stream
            if name.endswith(("attn.proj.weight", "mlp.proj.weight", "mlp.w2")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * self.config.n_layer))

    @staticmethod
    def _init_module(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, (MoE, nn.LayerNorm)):
            module.reset_parameters()  # experts normal(0, 0.02); LayerNorm gain 1, shift 0

    def forward(
        self, idx: torch.Tensor, *, return_aux: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Next-token logits for token ids ``idx`` (B, T) with T <= seq_len.

        Returns ``logits`` (B, T, vocab_size), or with ``return_aux=True`` the pair
        ``(logits, aux)`` where ``aux`` is a dict of 0-d tensors to add to the loss:
        ``{"moe_aux_loss": aux_loss_weight * mean over MoE blocks of the balance loss}`` for a
        mixture-of-experts model, ``{}`` for a dense one. It is a mean-type loss that the loss
        function must add itself (``ft.Loss.aux`` is reported, not differentiated)::

            def loss_fn(params, batch):
                logits, aux = ft.apply(model, params, batch["input"], return_aux=True)
                ce = ft.losses.cross_entropy(logits, batch["target"])
                moe = sum(aux.values(), torch.zeros(()))
                return ft.Loss(ce.total + moe * ce.count, ce.count, {"moe_aux_loss": moe.detach()})
        """
        if idx.dim() != 2:
            raise ValueError(
                f"GPT.forward: idx must be (B, T) token ids, got shape {tuple(idx.shape)}."
            )
        B, T = idx.shape
        if T > self.config.seq_len:
            raise ValueError(
                f"GPT.forward: sequence length T={T} exceeds config.seq_len={self.config.seq_len} "
                f"(the size of the position table). Fix: crop to idx[:, -{self.config.seq_len}:]."
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, d)
        balances = []
        for block in self.blocks:
            x, balance = block(x)
            if balance is not None:
                balances.append(balance)
        x = self.ln_f(x)
        if self.lm_head is None:
            logits = linear(x, self.wte.weight)  # (B, T, vocab): tied to the token embedding
        else:
            logits = self.lm_head(x)  # (B, T, vocab)
        if not return_aux:
            return logits
        aux = {}
        if balances:
            aux["moe_aux_loss"] = self.config.aux_loss_weight * torch.stack(balances).mean()
        return logits, aux
