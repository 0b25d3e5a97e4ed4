"""Argument checks the optimizers share: an unknown keyword names the legal ones and the closest
match (and how another library's name is said here); a number out of range names its range.
Errors are raised when the optimizer is built, never during a step."""

from __future__ import annotations

import difflib
import functools
import inspect

__all__ = ["checked", "check_range", "check_lr"]

# Names other libraries use for an option, and how to say it here.
HINTS = {
    "betas": "ftrain takes the betas separately: b1=..., b2=....",
    "lr": "ftrain calls it learning_rate=....",
    "beta2_decay": "ftrain calls it decay_rate and takes it positive: decay_rate=0.8 is "
    "torch's beta2_decay=-0.8.",
    "eps": "adafactor takes its two epsilons separately: eps1=..., eps2=....",
    "d": "ftrain calls it clipping_threshold=....",
    "foreach": "ftrain's optimizers are always multi-tensor; adam, adamw and sgd take "
    "fused=False for the foreach chain (fused=None, the default, takes torch's fused kernel where "
    "one exists).",
    "fused": "torch has fused kernels for adam, adamw and sgd only, which take fused=...; this "
    "optimizer always runs its multi-tensor (foreach) chain: drop the option.",
    "amsgrad": "ftrain's Adam has no AMSGrad variant; drop the option.",
    "maximize": "negate the loss instead.",
}


def checked(fn):
    """Turn an unknown keyword into an error that lists the legal ones and the closest match."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        unknown = [k for k in kwargs if k not in sig.parameters]
        if unknown:
            k = unknown[0]
            close = difflib.get_close_matches(k, list(sig.parameters), n=2)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            if k in HINTS and not (k == "eps" and "eps" in sig.parameters):
                hint = " " + HINTS[k]
            raise TypeError(
                f"optim.{fn.__name__}: unknown option {k!r}.{hint} "
                f"Options: {', '.join(sig.parameters)}."
            )
        return fn(*args, **kwargs)

    return wrapper


def check_range(
    fn: str, name: str, value: float, lo: float, hi: float | None = None, *, open_lo: bool = False
) -> None:
    """An error naming ``optim.<fn>``, ``name`` and the legal range unless ``value`` is a number in
    ``[lo, hi)`` (``(lo, hi)`` with ``open_lo``; no upper bound without ``hi``)."""
    bad = not isinstance(value, (int, float)) or isinstance(value, bool) or value != value
    if bad or value < lo or (open_lo and value == lo) or (hi is not None and value >= hi):
        low = "(" if open_lo else "["
        rng = f"in {low}{lo}, {hi})" if hi is not None else f"{'>' if open_lo else '>='} {lo}"
        raise ValueError(f"optim.{fn}: {name} must be a number {rng}, got {value!r}.")


def check_lr(fn: str, lr) -> None:
    """A learning rate is a schedule, or a number >= 0."""
    if not callable(lr):
        check_range(fn, "learning_rate", lr, 0.0)
