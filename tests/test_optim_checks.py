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
