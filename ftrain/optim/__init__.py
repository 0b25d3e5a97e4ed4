"""Optimizers as pure ``(init, update)`` pairs over TensorDicts, optax-style.

>>> import torch, ftrain as ft
>>> from ftrain import optim
>>> params = ft.params_of(torch.nn.Linear(3, 2))
>>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3, weight_decay=0.1))
>>> state = opt.init(params)
>>> grads = params.apply(torch.ones_like)
>>> updates, state = opt.update(grads, state, params)
>>> new_params = optim.apply_updates(params, updates)
"""

from ftrain.optim import schedules
from ftrain.optim.alias import OPTIMIZERS, adafactor, adam, adamw, decay_mask, lion, sgd
from ftrain.optim.base import (
    GradientTransformation,
    apply_if_finite,
    chain,
    empty_state,
    identity,
    masked,
    state_bytes,
    stateless,
)
from ftrain.optim.factorized import scale_by_factored_rms, scale_by_param_block_rms
from ftrain.optim.inject import inject_hyperparams, set_hyperparams
from ftrain.optim.lamb import lamb, scale_by_trust_ratio
from ftrain.optim.muon import (
    NOT_HIDDEN,
    NS_COEFFICIENTS,
    ema_momentum,
    muon,
    muon_adamw,
    muon_labels,
    newton_schulz,
    orthogonalize,
    scale_by_shape,
)
from ftrain.optim.partition import partition
from ftrain.optim.primitives import (
    add_decayed_weights,
    clip_by_block_rms,
    clip_by_global_norm,
    global_norm,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_schedule,
    trace,
)
from ftrain.optim.quantized import adamw8bit, scale_by_adam_8bit
from ftrain.optim.schedule_free import schedule_free_adamw, schedule_free_eval_params
from ftrain.optim.schedules import (
    Schedule,
    constant,
    cosine_decay,
    inverse_sqrt,
    join,
    linear_decay,
    linear_schedule,
    linear_warmup,
    warmup_cosine,
    wsd,
)
from ftrain.optim.updates import apply_updates, update_and_apply

__all__ = [
    "GradientTransformation",
    "NOT_HIDDEN",
    "NS_COEFFICIENTS",
    "OPTIMIZERS",
    "Schedule",
    "adafactor",
    "adam",
    "adamw",
    "adamw8bit",
    "add_decayed_weights",
    "apply_if_finite",
    "apply_updates",
    "chain",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "constant",
    "cosine_decay",
    "decay_mask",
    "ema_momentum",
    "empty_state",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "inverse_sqrt",
    "join",
    "lamb",
    "linear_decay",
    "linear_schedule",
    "linear_warmup",
    "lion",
    "masked",
    "partition",
    "muon",
    "muon_adamw",
    "muon_labels",
    "newton_schulz",
    "orthogonalize",
    "scale",
    "scale_by_adam",
    "scale_by_adam_8bit",
    "scale_by_factored_rms",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_param_block_rms",
    "scale_by_schedule",
    "scale_by_shape",
    "scale_by_trust_ratio",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "schedules",
    "set_hyperparams",
    "sgd",
    "state_bytes",
    "stateless",
    "trace",
    "update_and_apply",
    "warmup_cosine",
    "wsd",
]
