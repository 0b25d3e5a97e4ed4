"""ftrain.optim.checks: every optimizer of `ftrain train --optimizer` refuses a misspelled option
and an out-of-range number when it is built, naming the legal options or range."""

import inspect

import pytest

from ftrain import optim


@pytest.mark.parametrize("name", sorted(optim.OPTIMIZERS))
def test_every_optimizer_names_its_options_for_an_unknown_one(name):
    make = optim.OPTIMIZERS[name]
    with pytest.raises(TypeError, match=r"unknown option 'lr'\. ftrain calls it learning_rate"):
        make(1e-3, lr=1e-3)
    with pytest.raises(TypeError, match=r"unknown option 'wieght_decay'.*Did you mean"):
        make(1e-3, wieght_decay=0.1)


@pytest.mark.parametrize("name", sorted(optim.OPTIMIZERS))
def test_every_optimizer_refuses_a_negative_learning_rate_or_decay(name):
    make = optim.OPTIMIZERS[name]
    with pytest.raises(ValueError, match=r"learning_rate must be a number >= 0"):
        make(-1.0)
    if "weight_decay" in inspect.signature(make).parameters:
        with pytest.raises(ValueError, match=r"weight_decay must be a number >= 0"):
            make(1e-3, weight_decay=-0.1)


@pytest.mark.parametrize("name", ["adam", "adamw", "lamb", "adamw8bit", "lion"])
def test_betas_must_be_in_the_unit_interval(name):
    with pytest.raises(ValueError, match=r"b1 must be a number in \[0.0, 1.0\)"):
        optim.OPTIMIZERS[name](1e-3, b1=1.0)


# --- each error names the argument and the fix ----------------------------------------------------


def test_unknown_optimizer_option_names_the_fix():
    with pytest.raises(TypeError, match=r"unknown option 'betas'.*b1=\.\.\., b2=\.\.\."):
        optim.adamw(betas=(0.9, 0.95))
    with pytest.raises(TypeError, match=r"'lr'.*learning_rate=.*Options: learning_rate, b1"):
        optim.adam(lr=1e-3)
    with pytest.raises(TypeError, match="Did you mean 'weight_decay'"):
        optim.sgd(weight_decy=0.1)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: optim.adamw(-1e-3), r"adamw: learning_rate must be a number >= 0.0, got -0.001"),
        (lambda: optim.adamw(b1=1.0), r"adamw: b1 must be a number in \[0.0, 1.0\), got 1.0"),
        (lambda: optim.adam(b2=-0.1), r"adam: b2 must be a number in \[0.0, 1.0\)"),
        (lambda: optim.adamw(eps=-1.0), r"adamw: eps must be a number >= 0.0"),
        (lambda: optim.adamw(weight_decay=float("nan")), r"weight_decay must be a number"),
        (lambda: optim.sgd(0.1, momentum=1.5), r"sgd: momentum must be a number in \[0.0, 1.0\)"),
        (lambda: optim.sgd(0.1, nesterov=True), r"nesterov=True needs momentum > 0"),
        (lambda: optim.lion(b2="0.99"), r"lion: b2 must be a number"),
        (lambda: optim.adafactor(decay_rate=-0.8), r"adafactor: decay_rate must be a number >= 0"),
        (lambda: optim.adafactor(eps2=-1.0), r"adafactor: eps2 must be a number >= 0"),
        (
            lambda: optim.scale_by_learning_rate("fast"),
            r"learning rate must be a number or a schedule",
        ),
        (lambda: optim.scale_by_learning_rate(-1.0), r"learning rate must be >= 0"),
    ],
)
def test_invalid_hyperparameters_are_refused_at_build_time(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()
