"""docs/transforms.md: its code runs, and the three transforms it teaches (gradient noise, a spike
guard, per-block gradient norms) keep their promises alone and composed with accumulate,
autocast(fp16), shard("ddp") on 2 processes and compile."""

import re
from pathlib import Path

import pytest
import torch

import ftrain as ft
from ftrain.internals import dynamo
from ftrain.models import GPT, GPTConfig
from ftrain.testing import assert_no_recompile, assert_one_graph, max_rel_error, run_distributed

DOC = Path(__file__).parents[2] / "docs" / "transforms.md"


def _run_doc(upto: str | None = None) -> dict:
    """Run the doc's Python blocks in order in one namespace; stop once ``upto`` is defined."""
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S):
        try:
            exec(compile(block, str(DOC), "exec"), namespace)
        except RuntimeError as e:
            # the one-graph check, the last statement of its block (nothing skipped), on a torch whose dynamo cannot
            # trace a whole step (2.11): the refusal the guide documents
            if dynamo.traces_whole_steps() or "cannot capture a step as one graph" not in str(e):
                raise
            after = block.rsplit("assert_one_graph(", 1)[-1].splitlines()[1:]
            assert all(not line.strip() or line.lstrip().startswith("#") for line in after)
        if upto in namespace:
            break
    return namespace


@pytest.fixture(scope="module")
def doc():
    return _run_doc()


def test_docs_examples_run(doc):
    """Every Python block runs, in order, as one script, and builds what it says."""
    assert doc["step"].names == ("clip_report", "accumulate", "checkpoint", "compile")
    assert doc["guarded"].names[:3] == ("gradient_noise", "spike_guard", "block_grad_norms")
    assert {"grad_norm/blocks.0", "grad_norm/blocks.3", "spike", "noise_std"} <= set(doc["metrics"])


# -- a small problem the checks share ---------------------------------------------------------


def _setup(seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=8, d_model=32, n_layer=2, n_head=2, bias=False))

    def loss_fn(params, batch):
        return ft.losses.cross_entropy(ft.apply(model, params, batch["input"]), batch["target"])

    return model, loss_fn


def _batch(rows, seed=0, scale_targets=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 257, (rows, 9), generator=g)
    return {"input": t[:, :-1], "target": t[:, 1:]}


def _sgd():
    return ft.optim.sgd(0.1)  # linear in the gradients: params differences are gradient differences


def _flat(td):
    return torch.cat([t.flatten() for t in ft.tree.leaves(td)])


# -- gradient noise -----------------------------------------------------------------------------


def test_gradient_noise_is_the_documented_normal_draw(doc):
    model, loss_fn = _setup()
    opt = _sgd()
    state = ft.TrainState.create(ft.params_of(model), opt, seed=3)
    plain = ft.train_step(loss_fn, opt)
    noisy = doc["GradientNoise"](eta=0.5, gamma=0.55)(plain)
    batch = _batch(4)
    s = state
    for _ in range(3):  # at steps 0, 1, 2 the variance is eta / (1 + t) ** gamma
        a, _ = plain(s, batch)
        b, m = noisy(s, batch)
        noise = (_flat(a.params) - _flat(b.params)) / 0.1  # sgd: lr * (grad + noise)
        std = (0.5 / (1 + int(s.step)) ** 0.55) ** 0.5
        key = ft.rng.fold_in(ft.rng.fold_in(s.rng, s.step), 0x6E6F6973)
        by_hand = torch.cat(
            [
                ft.rng.normal(ft.rng.fold_in(key, i), x.shape).flatten() * std
                for i, x in enumerate(ft.tree.leaves(s.params))
            ]
        )
        assert max_rel_error(noise, by_hand) < 1e-4
        assert abs(float(m["noise_std"]) - std) < 1e-12
        assert abs(noise.std().item() / std - 1) < 0.05  # and it is noise of that size
        s = b


def test_gradient_noise_is_once_per_step_whatever_the_micro_batches(doc):
    model, loss_fn = _setup()
    opt = _sgd()
    state = ft.TrainState.create(ft.params_of(model), opt)
    noisy = doc["GradientNoise"](eta=0.1)(ft.train_step(loss_fn, opt))
    whole, _ = noisy(state, _batch(8))
    split, _ = ft.accumulate(noisy, 4)(state, _batch(8))
    assert max_rel_error(_flat(split.params), _flat(whole.params)) < 1e-5


def test_gradient_noise_refuses_a_negative_variance(doc):
    with pytest.raises(ValueError, match="must be >= 0"):
        doc["GradientNoise"](eta=-1.0)


# -- spike guard ---------------------------------------------------------------------------------


def test_spike_guard_skips_a_spike_and_nothing_else(doc):
    model, loss_fn = _setup()
    opt = ft.optim.adamw(1e-3)
    guard = doc["SpikeGuard"](factor=3.0, warmup=2)(ft.train_step(loss_fn, opt))
    state = ft.TrainState.create(ft.params_of(model), opt)
    spiky = {"input": _batch(4)["input"], "target": _batch(4)["target"]}

    def spike_loss(params, batch):  # the same loss times 1000: a gradient spike
        loss = loss_fn(params, batch)
        return ft.Loss(loss.total * 1000, loss.count)

    spike_step = doc["SpikeGuard"](factor=3.0, warmup=2)(ft.train_step(spike_loss, opt))
    s = state
    for i in range(4):
        s, m = guard(s, _batch(4, seed=i))
        assert not bool(m["spike"])
    stats = s.extra["spike_guard"]
    before = s
    s, m = spike_step(s, spiky)
    assert bool(m["spike"])
    assert torch.equal(_flat(s.params), _flat(before.params))  # skipped: params untouched
    assert torch.equal(_flat(s.opt_state), _flat(before.opt_state))  # and the optimizer state
    assert int(s.step) == int(before.step) + 1
    assert torch.equal(s.extra["spike_guard", "mean"], stats["mean"])  # a spike is not averaged
    assert int(s.extra["spike_guard", "accepted"]) == int(stats["accepted"])
    s, m = guard(s, _batch(4, seed=9))  # the next ordinary step goes through
    assert not bool(m["spike"]) and not torch.equal(_flat(s.params), _flat(before.params))


def test_spike_guard_resumes_exactly_from_a_checkpoint(doc, tmp_path):
    model, loss_fn = _setup()
    opt = ft.optim.adamw(1e-3)
    guard = doc["SpikeGuard"](factor=1.5, warmup=1)(ft.train_step(loss_fn, opt))
    state = guard.init_extra(ft.TrainState.create(ft.params_of(model), opt))
    batches = [_batch(4, seed=i) for i in range(6)]
    s = state
    for b in batches[:3]:
        s, _ = guard(s, b)
    ft.save(s, tmp_path / "ck")
    resumed = ft.load(tmp_path / "ck", like=s)
    straight, flags_a = s, []
    for b in batches[3:]:
        straight, m = guard(straight, b)
        flags_a.append(bool(m["spike"]))
    flags_b = []
    for b in batches[3:]:
        resumed, m = guard(resumed, b)
        flags_b.append(bool(m["spike"]))
    assert flags_a == flags_b
    assert torch.equal(_flat(resumed.params), _flat(straight.params))
    assert torch.equal(_flat(resumed.extra), _flat(straight.extra))


# -- per-block gradient norms ------------------------------------------------------------------


def test_block_grad_norms_are_the_norms_of_each_blocks_gradient(doc):
    model, loss_fn = _setup()
    opt = _sgd()
    state = ft.TrainState.create(ft.params_of(model), opt)
    batch = _batch(6)
    step = doc["BlockGradNorms"]()(ft.train_step(loss_fn, opt))
    _, m = step(state, batch)
    # reference: autograd on the whole batch's mean loss, through the module itself
    model.load_state_dict(ft.state_dict_of(state.params), strict=False)
    model.zero_grad()
    logits = model(batch["input"])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["target"].flatten()).backward()
    for i, block in enumerate(model.blocks):
        want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in block.parameters()]))
        assert max_rel_error(m[f"grad_norm/blocks.{i}"], want) < 1e-5
    acc = ft.accumulate(step, 3)(state, batch)[1]
    assert max_rel_error(acc["grad_norm/blocks.1"], m["grad_norm/blocks.1"]) < 1e-5


# -- composed with the built-ins -------------------------------------------------------------------


def _all_three(doc, step):
    return doc["BlockGradNorms"]()(
        doc["SpikeGuard"](warmup=2)(doc["GradientNoise"](eta=1e-3)(step))
    )


def test_the_three_compose_with_fp16_autocast(doc):
    model, loss_fn = _setup()
    opt = _sgd()
    state = ft.TrainState.create(ft.params_of(model), opt)
    step = ft.autocast(_all_three(doc, ft.train_step(loss_fn, opt)), torch.float16)
    s = state
    for i in range(3):
        s, m = step(s, _batch(4, seed=i))
        assert {"skipped", "spike", "grad_norm/blocks.0", "noise_std"} <= set(m)
    assert torch.isfinite(_flat(s.params)).all()


@pytest.mark.usefixtures("whole_step_graphs")
def test_the_three_compile_as_one_graph(doc):
    model, loss_fn = _setup()
    opt = _sgd()
    state = ft.TrainState.create(ft.params_of(model), opt)
    assert_one_graph(_all_three(doc, ft.train_step(loss_fn, opt)), state, _batch(4))


def test_the_three_compile_without_recompiles(doc):
    model, loss_fn = _setup()
    opt = _sgd()
    state = ft.TrainState.create(ft.params_of(model), opt)
    step = _all_three(doc, ft.train_step(loss_fn, opt))
    torch._dynamo.reset()
    batches = [_batch(4, seed=i) for i in range(3)]
    compiled, _ = assert_no_recompile(ft.compile(step, backend="eager"), state, batches)
    eager = state
    for b in batches:
        eager, _ = step(eager, b)
    assert max_rel_error(_flat(compiled.params), _flat(eager.params)) < 1e-6


def _two_ranks():
    """On each of 2 ranks: the three transforms under ddp on its half of each batch."""
    import torch.distributed as dist

    doc = _run_doc(upto="BlockGradNorms")  # the classes, not the compiled examples after them
    rank = dist.get_rank()
    model, loss_fn = _setup()
    opt = _sgd()
    state = ft.TrainState.create(ft.params_of(model), opt)
    step = ft.shard(_all_three(doc, ft.train_step(loss_fn, opt)), "ddp")
    state = ft.shard_state(state, "ddp")
    metrics = []
    for i in range(3):
        b = _batch(8, seed=i)
        state, m = step(state, {k: v[4 * rank : 4 * rank + 4] for k, v in b.items()})
        metrics.append({k: v.clone() for k, v in m.items()})
    return {"params": _flat(state.params), "extra": _flat(state.extra), "metrics": metrics}


def test_the_three_under_ddp_equal_one_process(doc):
    ranks = run_distributed(_two_ranks, world_size=2)
    model, loss_fn = _setup()
    opt = _sgd()
    state = ft.TrainState.create(ft.params_of(model), opt)
    step = _all_three(doc, ft.train_step(loss_fn, opt))
    for i in range(3):
        state, m = step(state, _batch(8, seed=i))
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])  # the noise is the same on both
    assert max_rel_error(ranks[0]["params"], _flat(state.params)) < 1e-5
    assert max_rel_error(ranks[0]["extra"], _flat(state.extra)) < 1e-5
    for key in ("grad_norm/blocks.0", "grad_norm/blocks.1", "spike"):
        assert max_rel_error(ranks[0]["metrics"][-1][key].float(), m[key].float()) < 1e-5


# -- the hook tables are what the step resolves ---------------------------------------------------


def _table(header: str) -> list[list[str]]:
    """The rows of the markdown table whose header line starts with ``header``."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _alone() -> dict[str, ft.Step]:
    """Each built-in that needs no process group, applied alone (in a setting where it uses every
    hook it has) to a small GPT step."""
    model, loss_fn = _setup()
    opt = _sgd()
    plain = ft.train_step(loss_fn, opt)
    lora = ft.lora(model, rank=2, targets=["attn.qkv"])
    return {
        "accumulate": ft.accumulate(plain, 2),
        "checkpoint": ft.checkpoint(plain),
        "autocast": ft.autocast(plain, torch.float16, tf32=True),
        "compile": ft.compile(plain),
        "ema": ft.ema(plain),
        "wrap": ft.wrap(plain, lambda fn: lambda s, b: fn(s, b), init=lambda s: s),
        "lora": lora(plain),
        "dp_sgd": ft.dp_sgd(plain, 1.0, 1.0),
        "vmap": ft.vmap(plain),
        "offload": ft.offload(plain, "optimizer+gradients"),
    }


def _acting(step: ft.Step, name: str) -> set[str]:
    """The hooks at which the transform ``name`` acts in ``step``, as ``step.explain_rows()``
    reports them (the three wrap stages are one hook)."""
    rows = [r for r in step.explain_rows() if r.phase != "build" or r.hook != "capabilities"]
    return {r.hook.split("(")[0] for r in rows if name in r.transforms}


def test_the_hook_table_names_every_hook_once_and_the_builtins_using_each():
    rows = _table("| hook | what it can do | used by |")
    hooks = [re.match(r"`(\w+)\(", row[0]).group(1) for row in rows]
    assert hooks == list(ft.step.HOOKS)
    alone = _alone()
    for hook, row in zip(hooks, rows):
        listed = set(re.findall(r"`(\w+)`", row[2])) & set(alone)
        acting = {name for name, step in alone.items() if hook in _acting(step, name)}
        assert listed == acting, hook


def test_the_order_table_is_what_explain_reports():
    model, loss_fn = _setup()
    step = ft.train_step(loss_fn, _sgd())
    step = ft.compile(ft.checkpoint(ft.autocast(step, torch.float16)))
    documented = [tuple(row[:3]) for row in _table("| phase | hook | runs |")]
    assert documented == [(r.phase, r.hook, r.runs) for r in step.explain_rows()]


def test_the_capability_table_is_what_the_builtins_declare():
    from ftrain.step import capabilities

    sentences = {getattr(capabilities, n) for n in capabilities.__all__} - {capabilities.SHAREABLE}
    alone = {name: step.transforms[-1].capabilities() for name, step in _alone().items()}
    rows = _table("| capability | declared by |")
    documented = set()
    for sentence, declared_by in rows:
        if sentence.startswith("keeps state.extra"):
            continue
        assert sentence in sentences, sentence
        documented.add(sentence)
        listed = set(re.findall(r"`(\w+)`", declared_by)) & set(alone)
        assert listed == {name for name, caps in alone.items() if sentence in caps}, sentence
    assert documented == {s for s in sentences if isinstance(s, str)}
    pairs = [(a, b) for a, b, _ in _table("| one transform | the other | why |")]
    assert pairs == [(rule.a, rule.b) for rule in capabilities.RULES]
