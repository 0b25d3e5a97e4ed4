"""The train step: a record of (loss function, optimizer, transforms), its phases and the
``Transform`` protocol its transforms use.

    step = ft.train_step(loss_fn, optimizer)         # Step
    step = ft.accumulate(step, 4)                    # a built-in transform
    step = MyTransform(...)(step)                    # yours: the same protocol
    state, metrics = step(state, batch)
    print(step.explain())                            # which hook runs where, in order
"""

from ftrain.step import capabilities
from ftrain.step.core import Resolved, Step, train_step
from ftrain.step.engine import (
    AutogradEngine,
    BackwardPlan,
    GradEngine,
    GradientReducer,
    GradientSink,
    Grads,
    backward_plan,
)
from ftrain.step.func_engine import FuncEngine
from ftrain.step.transform import HOOKS, STAGES, Gradients, LossCall, StepFn, Transform

__all__ = [
    "AutogradEngine",
    "BackwardPlan",
    "FuncEngine",
    "GradEngine",
    "Gradients",
    "GradientReducer",
    "GradientSink",
    "Grads",
    "HOOKS",
    "LossCall",
    "Resolved",
    "STAGES",
    "Step",
    "StepFn",
    "Transform",
    "backward_plan",
    "capabilities",
    "train_step",
]
