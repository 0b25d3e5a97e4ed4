"""ftrain.step.transform: the ``ft.Transform`` protocol. A user's transform overriding a hook sees
it called at its phase, in the order transforms were applied, and has the power of a built-in
(split the batch, swap the gradient engine, wrap the loss call, rewrite the model, scale the loss,
reduce, change or skip the update, wrap the optimizer or the whole function at each stage); what a
transform declares in ``capabilities`` is checked against the one table of conflicts when the step
is built (both transforms named, in either order); ``step.explain()`` reports the resolved order;
a non-Step is refused.

The references are the plain step and gradients worked out by hand with torch.autograd.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import ftrain as ft
from ftrain import optim
from ftrain.apply import rewritten
from ftrain.internals.blocks import replace_forwards
from ftrain.optim import GradientTransformation
from ftrain.step import capabilities
from ftrain.testing import assert_steps_close

from _tiny import UNEVEN, Chain, gpt_step, lm_batch


def linear_setup(opt=None):
    """``(model, step, state, batch)``: a Linear(3, 2) fit by summed squared error over 6 rows."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)

    def loss_fn(params, batch):
        err = ft.apply(model, params, batch["x"]) - batch["y"]  # (rows, 2)
        return ft.Loss(err.pow(2).sum(), torch.tensor(len(err)))

    opt = opt or optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(6, 3, generator=g), "y": torch.randn(6, 2, generator=g)}
    return model, ft.train_step(loss_fn, opt), state, batch


def total_and_grads(model, state, batch):
    """By hand: the summed squared error and the gradient of its mean over the rows."""
    ref = copy.deepcopy(model)
    ref.load_state_dict(ft.state_dict_of(state.params))
    total = (ref(batch["x"]) - batch["y"]).pow(2).sum()
    (total / len(batch["x"])).backward()
    return total.detach(), {k: p.grad for k, p in ref.named_parameters()}


def delta(before, after) -> dict[str, torch.Tensor]:
    return {k: after.params[k] - before.params[k] for k in ("weight", "bias")}


# -- every hook at its phase ---------------------------------------------------------------------


class Recorder(ft.Transform):
    """Overrides every hook; each notes ``tag.hook`` in ``log`` and changes nothing."""

    def __init__(self, log: list[str], tag: str = "r"):
        self.log, self.tag = log, tag

    def note(self, what: str) -> None:
        self.log.append(f"{self.tag}.{what}")

    def optimizer(self, optimizer):
        self.note("optimizer")
        return optimizer

    def engine(self, engine):
        self.note("engine")

        def run(forward, params, pieces, scale):
            self.note(f"grad[{len(pieces)}]")
            return engine(forward, params, pieces, scale)

        return run

    def wrap(self, fn, stage):
        self.note(f"wrap.{stage}")

        def wrapped(state, batch):
            self.note(f"call.{stage}")
            out = fn(state, batch)
            self.note(f"return.{stage}")
            return out

        return wrapped

    def forward(self, fn):
        self.note("forward")
        inner = rewritten(fn, self, f"ft.{self.name}")

        def call(params, batch, state):
            self.note("forward{")
            out = inner(params, batch, state)
            self.note("}forward")
            return out

        return call

    def rewrite(self, module):  # the model rewrite of ``rewritten`` (ft.apply's Rewrite)
        self.note("rewrite")
        return module

    def init(self, state):
        self.note("init")
        return state

    def split(self, batch):
        self.note("split")
        return [batch]

    def loss_scale(self, state):
        self.note("loss_scale")
        return None

    def reduce(self, grads, sums):
        self.note("reduce")
        return grads, sums

    def gradients(self, g, state):
        self.note("gradients")
        return g


def in_order(log: list[str], *entries: str) -> bool:
    positions = [log.index(e) for e in entries]
    return positions == sorted(positions)


def test_each_hook_runs_at_its_phase_and_changes_nothing_by_default():
    model, step, state, batch = linear_setup()
    log: list[str] = []
    recorded = Recorder(log)(step)
    assert log == [  # building: components swapped, the loss call and the step wrapped
        "r.optimizer", "r.engine", "r.forward", "r.wrap.traced", "r.wrap.compile", "r.wrap.eager",
    ]  # fmt: skip

    log.clear()
    new, metrics = recorded(state, batch)
    stages = ("eager", "compile", "traced")
    assert sorted(log) == sorted(
        [f"r.{h}" for h in ("init", "loss_scale", "split", "grad[1]", "forward{", "rewrite")]
        + [f"r.{h}" for h in ("}forward", "reduce", "gradients")]
        + [f"r.{what}.{stage}" for what in ("call", "return") for stage in stages]
    )
    # set-up, the wraps from the outside in, forward (inside the engine), reduce, update
    assert in_order(log, "r.init", "r.call.eager", "r.call.compile", "r.call.traced", "r.split")
    assert in_order(log, "r.split", "r.grad[1]", "r.forward{", "r.rewrite", "r.}forward")
    assert in_order(log, "r.}forward", "r.reduce", "r.gradients", "r.return.traced")
    assert in_order(log, "r.return.traced", "r.return.compile", "r.return.eager")
    assert in_order(log, "r.loss_scale", "r.grad[1]")  # the engine gets the scale
    want, _ = step(state, batch)
    for k in ("weight", "bias"):
        assert torch.equal(new.params[k], want.params[k])


def test_hooks_run_in_the_order_the_transforms_were_applied():
    """Innermost first: ``a`` applied before ``b`` initializes, splits, rewrites the model (closer
    to its code), reduces and sees the gradients first; ``b``'s wraps, engine and forward wrap
    ``a``'s."""
    model, step, state, batch = linear_setup()
    log: list[str] = []
    both = Recorder(log, "b")(Recorder(log, "a")(step))
    log.clear()
    both(state, batch)
    for hook in ("init", "split", "rewrite", "reduce", "gradients"):
        assert in_order(log, f"a.{hook}", f"b.{hook}"), hook
    assert in_order(log, "b.forward{", "a.forward{", "a.}forward", "b.}forward")
    for stage in ("eager", "compile", "traced"):
        assert in_order(log, f"b.call.{stage}", f"a.call.{stage}", f"a.return.{stage}")
    assert in_order(log, "b.call.traced", "a.call.traced", "a.return.traced", "b.return.traced")
    assert in_order(log, "b.grad[1]", "a.grad[1]")


def test_the_wrapped_function_runs_once_per_step_and_the_forward_once_per_piece():
    model, step, state, batch = linear_setup()
    log: list[str] = []
    ft.accumulate(Recorder(log)(step), 3)(state, batch)
    assert log.count("r.call.eager") == 1 and log.count("r.forward{") == 3
    assert "r.grad[3]" in log


# -- each hook has the power of a built-in ---------------------------------------------------------


class FirstRowApart(ft.Transform):
    """Splits every batch into its first row and the rest."""

    def split(self, batch):
        return [{k: v[:1] for k, v in batch.items()}, {k: v[1:] for k, v in batch.items()}]


@dataclasses.dataclass(frozen=True, eq=False)
class SeenByEngine(ft.Transform):
    """Swaps in an engine that notes the pieces' rows and the loss scale, then runs the inner."""

    log: list

    def engine(self, engine):
        def run(forward, params, pieces, scale):
            self.log.append(([len(p["x"]) for p in pieces], scale))
            return engine(forward, params, pieces, scale)

        return run


def test_split_pieces_reach_the_engine_and_give_the_whole_batch_gradient():
    model, step, state, batch = linear_setup()
    log: list = []
    new, metrics = SeenByEngine(log)(FirstRowApart()(step))(state, batch)
    assert log == [([1, 5], None)]
    _, grads = total_and_grads(model, state, batch)
    for k, d in delta(state, new).items():
        torch.testing.assert_close(d, -0.1 * grads[k], rtol=1e-6, atol=1e-7)
    assert int(metrics["count"]) == 6


@dataclasses.dataclass(frozen=True, eq=False)
class ScaleBy(ft.Transform):
    """A constant loss scale."""

    value: float

    def capabilities(self):
        return {capabilities.SCALES_LOSS: f"{self.value}"}

    def loss_scale(self, state):
        return torch.tensor(self.value)


@pytest.mark.parametrize("value", [1024.0, 3.0])
def test_a_loss_scale_is_divided_out(value):
    """The engine backpropagates the scaled loss and the step divides the scale out: the update
    and the loss metric are those of the unscaled loss (to rounding)."""
    model, step, state, batch = linear_setup()
    log: list = []
    new, metrics = SeenByEngine(log)(ScaleBy(value)(step))(state, batch)
    assert float(log[0][1]) == value
    total, grads = total_and_grads(model, state, batch)
    torch.testing.assert_close(metrics["loss"], total / 6, rtol=1e-6, atol=0)
    for k, d in delta(state, new).items():
        torch.testing.assert_close(d, -0.1 * grads[k], rtol=1e-5, atol=1e-7)


@dataclasses.dataclass(frozen=True, eq=False)
class TwoIdenticalRanks(ft.Transform):
    """A reduction as if a second process had the same batch: sums doubled. Notes the sums."""

    log: list

    def reduce(self, grads, sums):
        self.log.append(sums.clone())
        return [g * 2 for g in grads], sums * 2


def test_reduce_gets_the_total_and_count_and_the_step_divides_by_the_reduced_count():
    model, step, state, batch = linear_setup()
    log: list = []
    new, metrics = TwoIdenticalRanks(log)(step)(state, batch)
    total, grads = total_and_grads(model, state, batch)
    (sums,) = log
    assert sums.dtype == torch.float32 and sums.shape == (2,)
    torch.testing.assert_close(sums, torch.stack([total, torch.tensor(6.0)]))
    assert int(metrics["count"]) == 12  # both "processes"' rows
    torch.testing.assert_close(metrics["loss"], total / 6)  # the same mean
    for k, d in delta(state, new).items():
        torch.testing.assert_close(d, -0.1 * grads[k], rtol=1e-6, atol=1e-7)


class HalveAndCount(ft.Transform):
    """Halves the gradients, reports their norm and counts its steps in ``state.extra``."""

    def init(self, state):
        if "calls" in state.extra.keys():
            return state
        extra = state.extra.clone(recurse=False)
        extra["calls"] = torch.zeros((), dtype=torch.int64)
        return state.replace(extra=extra)

    def gradients(self, g, state):
        grads = g.grads.apply(lambda t: t * 0.5)
        norm = torch.linalg.vector_norm(torch.cat([t.flatten() for t in ft.tree.leaves(grads)]))
        extra = g.extra.clone(recurse=False)
        extra["calls"] = state.extra["calls"] + 1
        return g._replace(grads=grads, metrics={**g.metrics, "half_norm": norm}, extra=extra)


def test_gradients_can_change_the_update_add_metrics_and_keep_state():
    model, step, state, batch = linear_setup()
    mine = HalveAndCount()(step)
    assert int(mine.init_extra(state).extra["calls"]) == 0
    new, metrics = mine(state, batch)
    assert "calls" not in state.extra.keys()  # the input state is untouched
    _, grads = total_and_grads(model, state, batch)
    for k, d in delta(state, new).items():
        torch.testing.assert_close(d, -0.05 * grads[k], rtol=1e-6, atol=1e-7)
    want = 0.5 * torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()]))
    torch.testing.assert_close(metrics["half_norm"], want)
    torch.testing.assert_close(metrics["grad_norm"], 2 * want)  # before the hook
    again, _ = mine(new, batch)
    assert int(again.extra["calls"]) == 2


@dataclasses.dataclass(frozen=True, eq=False)
class Skip(ft.Transform):
    skip: bool

    def gradients(self, g, state):
        return g._replace(skip=torch.tensor(self.skip))


def test_gradients_can_skip_the_update():
    """A skipped step keeps params and optimizer state; the step counter still moves."""
    _, step, state, batch = linear_setup(optim.sgd(0.1, momentum=0.9))
    state, _ = step(state, batch)  # a non-zero momentum trace
    skipped, _ = Skip(True)(step)(state, batch)
    for a, b in zip(ft.tree.leaves(skipped.params), ft.tree.leaves(state.params)):
        assert torch.equal(a, b)
    for a, b in zip(ft.tree.leaves(skipped.opt_state), ft.tree.leaves(state.opt_state)):
        assert torch.equal(a, b)
    assert int(skipped.step) == int(state.step) + 1
    taken, _ = Skip(False)(step)(state, batch)
    plain, _ = step(state, batch)
    for a, b in zip(ft.tree.leaves(taken), ft.tree.leaves(plain)):
        assert torch.equal(a, b)


def test_gradients_returning_other_keys_is_refused():
    class DropsBias(ft.Transform):
        def gradients(self, g, state):
            grads = g.grads.clone()
            del grads["bias"]
            return g._replace(grads=grads)

    _, step, state, batch = linear_setup()
    with pytest.raises(ValueError, match=r"gradients hook returned grads whose keys differ"):
        DropsBias()(step)(state, batch)


class HalfUpdates(ft.Transform):
    """Runs the optimizer, then halves its updates (its state is the inner optimizer's)."""

    def optimizer(self, inner):
        def update(updates, state, params=None):
            u, new_state = inner.update(updates, state, params)
            return u.apply(lambda t: t * 0.5), new_state

        return GradientTransformation(inner.init, update)


def test_the_optimizer_hook_wraps_the_optimizer_the_step_runs():
    model, step, state, batch = linear_setup()
    new, _ = HalfUpdates()(step)(state, batch)
    _, grads = total_and_grads(model, state, batch)
    for k, d in delta(state, new).items():
        torch.testing.assert_close(d, -0.05 * grads[k], rtol=1e-6, atol=1e-7)


@dataclasses.dataclass(frozen=True, eq=False)
class Tagged(ft.Transform):
    """Runs the model rewritten so that its forward first notes ``tag`` in ``log``."""

    log: list
    tag: str

    def forward(self, fn):
        return rewritten(fn, self, f"ft.{self.name}")

    def rewrite(self, module):
        def make(current):
            def forward(*args, **kwargs):
                self.log.append(self.tag)
                return current(*args, **kwargs)

            return forward

        return replace_forwards(module, [(module, make)])


class TaggedGathering(Tagged):
    def capabilities(self):
        return {capabilities.GATHERS_PARAMS: ""}  # as fsdp: runs inside the other rewrites


def test_rewrites_nest_as_applied_unless_a_capability_puts_them_inside():
    """The rewrite applied last runs outermost; one that gathers params (fsdp) runs closer to the
    module's own code whatever the order of application, so that a block that activation
    checkpointing recomputes gathers again."""
    torch.manual_seed(0)
    model = Chain(2)
    opt = optim.sgd(0.1)
    step = ft.train_step(lambda p, x: ft.apply(model, p, x).pow(2).mean(), opt)
    state = ft.TrainState.create(ft.params_of(model), opt)
    x = torch.randn(4, 16)
    log: list[str] = []
    Tagged(log, "b")(Tagged(log, "a")(step))(state, x)
    assert log == ["b", "a"]
    log.clear()
    TaggedGathering(log, "b")(Tagged(log, "a")(step))(state, x)
    assert log == ["a", "b"]
    want, _ = step(state, x)  # and the forward is the model's own
    got, _ = Tagged(log, "a")(step)(state, x)
    for a, b in zip(ft.tree.leaves(got.params), ft.tree.leaves(want.params)):
        assert torch.equal(a, b)


# -- composition -----------------------------------------------------------------------------------


def test_all_orders_of_accumulate_checkpoint_autocast_agree():
    _, step, state = gpt_step(dropout=0.1)
    batch = lm_batch(8, lengths=UNEVEN)
    transforms = {
        "accumulate": lambda s: ft.accumulate(s, 4),
        "checkpoint": lambda s: ft.checkpoint(s, "blocks"),
        "autocast": lambda s: ft.autocast(s, torch.bfloat16),
    }
    built = {}
    for order in itertools.permutations(transforms):
        s = step
        for name in order:
            s = transforms[name](s)
        built[order] = s
    (first, reference), *others = built.items()
    for order, s in others:
        assert len(s.split(batch)) == 4
        try:
            assert_steps_close(s, reference, state, batch, steps=1, rtol=1e-6)
        except AssertionError as e:
            raise AssertionError(f"order {order} differs from {first}: {e}") from None


# -- conflicts between built-ins and yours, checked when the step is built ----------------------


def test_one_loss_scale_per_step():
    _, step, _, _ = linear_setup()
    with pytest.raises(ValueError, match=r"ft\.scale_by was applied twice: 4\.0, then 2\.0"):
        ScaleBy(2.0)(ScaleBy(4.0)(step))
    with pytest.raises(ValueError, match=r"ft\.scale_by scales the loss.*and so does ft\.autocast"):
        ft.autocast(ScaleBy(2.0)(step), torch.float16)
    assert ft.autocast(ScaleBy(2.0)(step), torch.bfloat16).names == ("scale_by", "autocast")


def test_an_inner_hook_applied_after_compile_is_compiled_with_the_step():
    """A transform's inner hooks act the same whether it comes before or after ft.compile."""

    class Metric(ft.Transform):
        def wrap(self, fn, stage):
            return fn

    _, step, state, batch = linear_setup()
    after, m_after = HalveAndCount()(ft.compile(step, backend="eager"))(state, batch)
    before, m_before = ft.compile(HalveAndCount()(step), backend="eager")(state, batch)
    plain, _ = step(state, batch)
    assert torch.equal(after.params["weight"], before.params["weight"])
    assert not torch.equal(after.params["weight"], plain.params["weight"])  # it did act
    assert int(after.extra["calls"]) == 1 and torch.equal(
        m_after["half_norm"], m_before["half_norm"]
    )
    assert Metric()(ft.compile(step)).names == ("compile", "metric")


# -- not a step ------------------------------------------------------------------------------------


class GradNoise(ft.Transform):
    pass


def test_a_transform_of_something_else_than_a_step_is_refused():
    def my_step(state, batch):
        return state, {}

    with pytest.raises(
        TypeError, match=r"ft\.grad_noise\(step\): expected an ft\.Step, got int\.$"
    ):
        GradNoise()(3)
    with pytest.raises(TypeError, match=r"expected an ft\.Step, got function.*ft\.train_step"):
        GradNoise()(my_step)


@pytest.mark.parametrize(
    "transform",
    [
        lambda s: ft.accumulate(s, 2),
        lambda s: ft.checkpoint(s),
        lambda s: ft.autocast(s),
        lambda s: ft.compile(s),
        lambda s: ft.ema(s),
        lambda s: ft.wrap(s, lambda fn: fn),
    ],
    ids=["accumulate", "checkpoint", "autocast", "compile", "ema", "wrap"],
)
def test_a_builtin_transform_of_a_plain_function_is_refused(transform):
    def my_step(state, batch):
        return state, {}

    with pytest.raises(TypeError, match=r"expected an ft\.Step, got function.*ft\.train_step"):
        transform(my_step)


@dataclasses.dataclass(frozen=True, eq=False)
class Frozen(ft.Transform):
    """Hands the loss function ``params`` plus a frozen ``b`` kept in ``state.extra``."""

    def forward(self, fn):
        def with_frozen(params, batch, state):
            both = params.clone(recurse=False)
            both["b"] = state.extra["frozen"]
            return fn(both, batch, state)

        return with_frozen


def test_forward_adds_what_the_loss_uses_but_the_step_does_not_differentiate():
    x, y = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, -1.0, 2.0])
    w, b = torch.tensor([0.3, -0.2, 0.1]), torch.tensor([1.0, 0.0, -1.0])

    def loss_fn(params, batch):
        return ((params["w"] * batch[0] + params["b"] - batch[1]) ** 2).sum()

    opt = optim.sgd(0.1)
    state = ft.TrainState.create(TensorDict({"w": w}, []), opt)
    state = state.replace(extra=TensorDict({"frozen": b}, []))
    new, _ = Frozen()(ft.train_step(loss_fn, opt))(state, (x, y))
    grad = 2 * (w * x + b - y) * x  # by hand: d/dw of the summed squares
    assert torch.allclose(new.params["w"], w - 0.1 * grad)
    assert list(new.params.keys()) == ["w"] and torch.equal(new.extra["frozen"], b)


@pytest.mark.parametrize(
    "body, says",
    [
        ("def around_forward(self, params): pass", r"around_forward: not an ft\.Transform hook"),
        ("def loss_params(self, params, state): pass", r"forward\(fn\) can call the loss"),
        ("once = True", r"declare a capability of its own"),
        ("def wrap(self, fn): return fn", r"wrap\(self, fn, stage\)"),
        ("def rewrite(self, module): return module", r"rewrite: .*define forward\(self, fn\)"),
    ],
)
def test_a_method_the_step_would_never_call_is_refused_where_it_is_written(body, says):
    """A transform written for another protocol (or with a typo'd signature) does not silently
    train without its behaviour: defining the class is the error, naming the hook to use."""
    with pytest.raises(TypeError, match=says):
        exec(f"class Old(ft.Transform):\n    {body}\n", {"ft": ft})
