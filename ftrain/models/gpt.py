"""A GPT language model in one file, in the spirit of nanoGPT: config, attention, MLP, block, GPT.

    >>> import torch
    >>> from ftrain.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2))
    >>> idx = torch.randint(0, 257, (2, 16))
    >>> model(idx).shape  # (B, T, vocab_size)
    torch.Size([2, 16, 257])

The module holds parameters only (no buffers, nothing written to ``self`` during forward), so it
can be used as a stateless template through ``torch.func.functional_call`` / ``ft.apply``. With
``n_experts > 0`` each block's feed-forward is a mixture of experts (``ftrain.models.moe``), whose
load-balancing loss comes back as a value: ``logits, aux = model(idx, return_aux=True)``.
``GPTConfig.matmul`` picks the matmul kernel of every linear layer (``MATMULS``; ``"auto"``, the
default, takes the one measured faster on this machine for this model: ``choose_matmul``). Train one on bytes with
``ftrain train`` (``ftrain train --help`` lists the model flags).

References:
  1) GPT-2: Radford et al. 2019, and karpathy/nanoGPT model.py
"""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from ftrain.models.moe import MoE
from ftrain.models.onednn import Linear, faster_linear, linear

# The kernels GPTConfig.matmul may name: the layer class of every linear of the model, and the
# function of the tied lm head (whose weight is the embedding's, so it is not a layer). Same
# parameters either way. "auto" is not a kernel: GPT resolves it to one of these (choose_matmul).
# The MoE experts' batched weights are not linears: they always use torch.mm. Read-only.
MATMULS = types.MappingProxyType(
    {
        # oneDNN for float32 products on an x86 CPU large enough to pay for its call
        # (onednn.MIN_MACS), F.linear everywhere else (GPU, bf16, autocast, small products)
        "onednn": (Linear, linear),
        # PyTorch's own matmul everywhere (MKL on the x86 CPU, cuBLAS on a GPU)
        "torch": (nn.Linear, F.linear),
    }
)


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
    matmul: str = "auto"  # the linears' kernel (MATMULS): "onednn", "torch", or "auto": the faster
    # of the two on this machine for this model, timed when the GPT is built (choose_matmul)

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
        if self.matmul != "auto" and self.matmul not in MATMULS:
            raise ValueError(
                f"GPTConfig: matmul={self.matmul!r} must be one of {['auto', *MATMULS]} ('auto': "
                f"the faster on this machine, timed; 'onednn': oneDNN for large CPU float32 "
                f"matmuls, else F.linear; 'torch': plain nn.Linear). Fix: matmul='auto'."
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

    def make_linear(self, d_in: int, d_out: int, *, bias: bool) -> nn.Linear:
        """A ``d_in -> d_out`` linear layer of the class ``matmul`` selects (an ``nn.Linear`` or
        its subclass ``ftrain.models.Linear``: same parameters, init and state_dict keys). Every
        linear of the model, MoE routers included, is built here, from the config whose
        ``matmul`` the GPT has resolved; a layer built alone from an ``"auto"`` config (no model
        shapes to time) is torch's own ``nn.Linear``."""
        layer, _ = MATMULS["torch" if self.matmul == "auto" else self.matmul]
        return layer(d_in, d_out, bias=bias)


def linear_shapes(config: GPTConfig) -> list[tuple[int, int, int]]:
    """``(d_in, d_out, count)`` of every matmul that :func:`choose_matmul` weighs: each block's
    qkv, attention projection, and MLP (or MoE router), and the lm head (tied or not)."""
    d, ff, n = config.d_model, config.ff_dim, config.n_layer
    shapes = [(d, 3 * d, n), (d, d, n)]  # attn.qkv, attn.proj
    if config.n_experts == 0:
        shapes += [(d, ff, n), (ff, d, n)]  # mlp.fc, mlp.proj
    else:
        shapes += [(d, config.n_experts, n)]  # the router (the experts use torch.mm either way)
    return shapes + [(d, config.vocab_size, 1)]  # the lm head


def choose_matmul(config: GPTConfig, rows: int | None = None) -> str:
    """The kernel (a key of ``MATMULS``) that ``config.matmul`` stands for: itself when it names
    one, and for ``"auto"`` the faster of ``"onednn"`` and ``"torch"`` on this machine for this
    model's linears (:func:`linear_shapes`) at ``rows`` rows per forward (batch * seq_len; None:
    ``16 * seq_len``, the default run's batch of 16), measured by
    ``ftrain.models.onednn.faster_linear`` (and kept in its cache).

    **Invariant:** never slower than ``"torch"`` beyond timing noise. The kernels agree to float32
    rounding, not bitwise, so a run that must be continued bit for bit records the answer (the
    built model's ``GPT.matmul``) and builds with ``GPTConfig(matmul=answer)`` on resume.
    """
    if config.matmul != "auto":
        return config.matmul
    return faster_linear(linear_shapes(config), 16 * config.seq_len if rows is None else rows)


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
        self.qkv = config.make_linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = config.make_linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, d) -> (B, T, d). ``mask`` (B, 1, T, T) bool, True where a query may attend to a
        key, replaces the causal mask (``document_mask`` for packed rows)."""
        # chunk (not a reshape to (3, ...)): its backward is a single concatenation of dq, dk, dv;
        # by thirds, not by d, so that a tensor-parallel copy (d / tp features each) splits too
        qkv = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, T, d)
        q, k, v = (rearrange(z, "b t (nh hs) -> b nh t hs", nh=self.n_head) for z in qkv)
        # q, k, v: (B, nh, T, hs). Flash attention on GPU (no (T, T) score matrix in memory); the
        # causal mask is built inside the kernel. A given mask (packed rows) takes the
        # memory-efficient or math kernel instead.
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            dropout_p=self.dropout if self.training else 0.0,
        )  # (B, nh, T, hs)
        y = rearrange(y, "b nh t hs -> b t (nh hs)")  # (B, T, d): heads side by side again
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """The dense feed-forward: Linear(d, d_ff) -> GELU -> Linear(d_ff, d) -> dropout."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = config.make_linear(config.d_model, config.ff_dim, bias=config.bias)
        self.proj = config.make_linear(config.ff_dim, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., d)."""
        h = F.gelu(self.fc(x))  # (..., d_ff)
        return self.drop(self.proj(h))  # (..., d)


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
        self.mlp = MLP(config) if config.n_experts == 0 else MoE(config)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T, d) -> ((B, T, d), this block's MoE balance loss, or None for a dense MLP);
        ``mask`` as in :class:`CausalSelfAttention`."""
        x = x + self.attn(self.ln_1(x), mask)
        if isinstance(self.mlp, MoE):
            y, balance = self.mlp(self.ln_2(x))
        else:
            y, balance = self.mlp(self.ln_2(x)), None
        return x + y, balance


class GPT(nn.Module):
    """A decoder-only transformer language model: token ids (B, T) -> next-token logits.

    Layout: ``wte`` (token embedding), ``wpe`` (learned positions), ``blocks`` (an
    ``nn.ModuleList`` of :class:`Block`; activation checkpointing finds them there), ``ln_f``,
    then the lm head. With ``tie_weights`` the lm head *is* ``wte.weight`` (``x @ wte.weight.T``)
    and there is no separate ``lm_head`` parameter, so ``named_parameters()`` and ``state_dict()``
    have the same keys and no tensor is stored twice (safetensors refuses shared tensors). Without
    tying, ``lm_head`` is a linear ``d_model -> vocab_size`` without bias. Every linear comes from
    ``make_linear`` of the config with ``matmul`` resolved (``choose_matmul``; the answer is
    ``model.matmul``, ``model.config`` is the config as given): ``ftrain.models.Linear`` (oneDNN
    matmuls for CPU float32) for ``"onednn"``, ``nn.Linear`` for ``"torch"``; the parameters and
    state_dict keys are the same.

    Guarantees: the module has no buffers and ``forward`` writes nothing to ``self``, so it is a
    pure function of (parameters, idx) and, in training mode, the random state used by dropout.
    Logits at position t depend on ``idx[:, :t+1]`` only. Init follows GPT-2: weights
    ``normal(0, 0.02)``, residual output projections ``normal(0, 0.02 / sqrt(2 * n_layer))``,
    biases zero.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        # the kernel "auto" stands for on this machine (timed once, cached): a run records it
        self.matmul = choose_matmul(config)
        config = dataclasses.replace(config, matmul=self.matmul)
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
        # the function of the model's linears, for the tied head; looked up here, not in forward
        # (torch.compile breaks its graph on a read of the read-only MATMULS)
        self.head_matmul = MATMULS[self.matmul][1]
        if config.tie_weights:
            self.lm_head = None  # the output projection is wte.weight, see forward
        else:
            self.lm_head = config.make_linear(config.d_model, config.vocab_size, bias=False)
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
        self,
        idx: torch.Tensor,
        *,
        return_aux: bool = False,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Next-token logits for token ids ``idx`` (B, T) with T <= seq_len.

        ``position_ids`` (B, T), for packed rows of several documents: the positions of the tokens
        (restarting at 0 where a document starts, ``ftrain.data.restarting_positions``), and
        attention stays within each run of consecutive positions (``document_mask``). So each
        document's logits are those it gets alone. Default: positions 0..T-1, causal attention.

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
        mask = None
        if position_ids is None:
            pos = torch.arange(T, device=idx.device)  # (T,)
        else:
            if position_ids.shape != idx.shape:
                raise ValueError(
                    f"GPT.forward: position_ids must have the shape of idx {tuple(idx.shape)}, got "
                    f"{tuple(position_ids.shape)}; pass the batch's 'position_ids' (--pack)"
                )
            pos, mask = position_ids, document_mask(position_ids)  # (B, T), (B, 1, T, T)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, d)
        balances = []
        for block in self.blocks:
            x, balance = block(x, mask)
            if balance is not None:
                balances.append(balance)
        x = self.ln_f(x)  # (B, T, d)
        if self.lm_head is None:
            logits = self.head_matmul(x, self.wte.weight)  # (B, T, vocab): tied to wte
        else:
            logits = self.lm_head(x)  # (B, T, vocab)
        if not return_aux:
            return logits
        aux = {}
        if balances:
            aux["moe_aux_loss"] = self.config.aux_loss_weight * torch.stack(balances).mean()
        return logits, aux


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed rows: (B, T) positions -> (B, 1, T, T) bool, True where query
    t may attend to key s: s <= t and both in one document. A document is a run of positions that
    each go up by one (a new one starts wherever they do not, as Hugging Face models read
    ``position_ids``): a block-diagonal causal mask."""
    first = position_ids[:, :1] - 1  # (B, 1): so that position 0 continues "a run"
    doc = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)  # (B, T)
    T = position_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()  # (T, T)
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # (B, 1, T, T)
