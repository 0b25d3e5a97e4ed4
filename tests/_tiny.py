"""The tiny models, loss and batches the suite trains again and again.

Factories take arguments (a seed, a config field), so they are plain functions imported by the
tests; ``conftest.py`` holds the fixtures (objects shared as they are).

    model = tiny_gpt(n_layer=4, dropout=0.1)     # a GPT of width 32 on 16 tokens of 64 symbols
    step = ft.train_step(lm_loss(model), opt)     # token cross-entropy, as an ft.Loss
    state, metrics = step(state, lm_batch(8, seed=1, lengths=[16, 3, ...]))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

import ftrain as ft
from ftrain.models import GPT, GPTConfig

VOCAB, T = 64, 16  # vocabulary size and sequence length of the tiny GPT and its batches

# 2 blocks of width 32 with 4 heads, the lm head tied to the embedding: about 28k parameters.
TINY_GPT = dict(vocab_size=VOCAB, seq_len=T, d_model=32, n_layer=2, n_head=4)


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    """A GPT of config ``TINY_GPT`` (any ``GPTConfig`` field overrides: ``dropout``,
    ``n_layer``, ``bias``, ...), initialized after ``torch.manual_seed(seed)``: the same
    arguments give the same weights."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY_GPT, **overrides}))


def lm_loss(model: nn.Module):
    """``loss_fn(params, batch)``: the token cross-entropy of ``model`` on ``batch["input"]``
    against ``batch["target"]`` (-100 ignored), as an ``ft.Loss`` (sum over valid tokens, their
    number)."""

    def loss_fn(params, batch):
        logits = ft.apply(model, params, batch["input"])  # (B, T, V)
        return ft.losses.cross_entropy(logits, batch["target"])

    return loss_fn


def tokens(rows: int = 3, length: int = T, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    """Random token ids ``(rows, length)`` in ``[0, vocab)``, a function of ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, length), generator=g)


# Valid target positions per row, from 1 to T: micro-batches (and ranks) of a batch padded this way
# hold very different numbers of tokens, so the mean of their mean losses is not the mean loss.
UNEVEN = (T, 1, 3, T, 9, 2, T - 1, 5, 12, 1, 7, T, 2, 4, 11, 6)


def lm_batch(
    rows: int = 4,
    seed: int = 0,
    *,
    lengths: Sequence[int] | None = None,
    vocab: int = VOCAB,
    length: int = T,
) -> dict[str, torch.Tensor]:
    """A language-model batch ``{"input", "target"}`` of random tokens ``(rows, length)``, a
    function of ``seed``. Row ``i`` predicts only its first ``lengths[i]`` positions (its target
    is -100 after them; e.g. ``lengths=UNEVEN``); every position when ``lengths`` is None."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (rows, length), generator=g)
    y = torch.randint(0, vocab, (rows, length), generator=g)
    if lengths is not None:
        if len(lengths) < rows:
            raise ValueError(f"lm_batch: {len(lengths)} lengths for {rows} rows")
        valid = torch.arange(length) < torch.tensor(lengths[:rows])[:, None]  # (rows, length)
        y = torch.where(valid, y, -100)
    return {"input": x, "target": y}


def gpt_step(opt=None, *, seed: int = 1, **model_kw):
    """``(model, step, state)``: ``tiny_gpt(**model_kw)`` trained on :func:`lm_loss` with ``opt``
    (default SGD with momentum: linear in the gradients, and its momentum trace after one step
    *is* the gradient, so comparing states compares gradients), from a state seeded ``seed``."""
    model = tiny_gpt(**model_kw)
    opt = opt or ft.optim.sgd(0.5, momentum=0.9)
    state = ft.TrainState.create(ft.params_of(model), opt, seed=seed)
    return model, ft.train_step(lm_loss(model), opt), state


# -- small modules -------------------------------------------------------------------------------


class Net(nn.Module):
    """Two Linear(d, d) blocks in a ModuleList and a BatchNorm: parameters and buffers."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])
        self.norm = nn.BatchNorm1d(d)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.norm(x)


# -- a chain of MLP blocks: sizes simple enough to count bytes by hand ---------------------------

D, H = 16, 64  # width, hidden width of each block


class MLPBlock(nn.Module):
    """relu(fc2(relu(fc1(x)))): keeps relu(fc1 x) (H floats a row) and its output (D) for
    backward."""

    def __init__(self, d: int = D, h: int = H):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return torch.relu(self.fc2(torch.relu(self.fc1(x))))


class Chain(nn.Module):
    """``n`` MLP blocks in an ``nn.ModuleList``, one after the other."""

    def __init__(self, n: int, d: int = D, h: int = H):
        super().__init__()
        self.blocks = nn.ModuleList([MLPBlock(d, h) for _ in range(n)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def chain_step(n: int, opt=None, *, seed: int = 0):
    """``(step, state, model)`` for a :class:`Chain` of ``n`` blocks trained on the mean square
    of its output (a plain scalar loss), with ``opt`` (default SGD with momentum 0.9)."""
    torch.manual_seed(seed)
    model = Chain(n)
    opt = opt or ft.optim.sgd(0.1, momentum=0.9)
    state = ft.TrainState.create(ft.params_of(model), opt)
    step = ft.train_step(lambda p, x: ft.apply(model, p, x).pow(2).mean(), opt)
    return step, state, model


# -- token pairs for the optimizer comparisons (test_optim*.py) --------------------------------


def make_batches(n: int = 50, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` pairs ``(input, target)`` of random tokens, (4, 16) each, the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g))
        for _ in range(n)
    ]


def mean_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy as a plain mean, as a torch.optim loop computes it."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def flat(td) -> dict[str, torch.Tensor]:
    """A TensorDict's leaves keyed by dotted path."""
    return dict(td.flatten_keys(".").items())


def _paired(a, b) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The leaves of two trees (TensorDicts or TrainStates) paired by path; an AssertionError
    when their paths differ or they hold none (so a comparison can never pass vacuously)."""
    left = dict(zip(ft.tree.paths(a), ft.tree.leaves(a)))
    right = dict(zip(ft.tree.paths(b), ft.tree.leaves(b)))
    assert left and left.keys() == right.keys(), sorted(left.keys() ^ right.keys())[:4]
    return [(k, v, right[k]) for k, v in left.items()]


def max_tree_diff(a, b) -> float:
    """The largest ``|a - b|`` over the leaves of two trees with the same paths."""
    return max(float((x.double() - y.double()).abs().max()) for _, x, y in _paired(a, b))


def assert_trees_close(a, b, tol: float) -> None:
    """Every leaf of ``a`` within ``tol`` (absolute and relative) of ``b``'s at the same path,
    dtype and shape included; ``tol=0``: bitwise equal (up to the sign of zero)."""
    for path, x, y in _paired(a, b):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol, msg=lambda m, p=path: f"{p}: {m}")
