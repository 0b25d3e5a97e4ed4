"""ft.memory: the predicted peak against the peak the real step allocates (ftrain.testing.peak_bytes),
over micro-batches x checkpoint policy x precision x optimizer on two model sizes; a 7B plan in
bounded time and memory; the phases it reports."""

import itertools
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import ftrain as ft
from ftrain import optim
from ftrain.testing import peak_bytes

from _memory_ranks import SHARDED
from _tiny import lm_batch, lm_loss, tiny_gpt

OPTIMIZERS = {
    "adamw": lambda: optim.adamw(1e-3),
    "adafactor": lambda: optim.adafactor(1e-3),
    "adamw8bit": lambda: optim.adamw8bit(1e-3),
}
SIZES = {"small": dict(d_model=32, n_layer=2), "larger": dict(d_model=64, n_layer=3, seq_len=32)}


def composed(size, k, policy, precision, opt_name, rows=8, donate=False):
    model = tiny_gpt(**SIZES[size])
    opt = OPTIMIZERS[opt_name]()
    step = ft.train_step(lm_loss(model), opt, donate=donate)
    if precision == "bf16":
        step = ft.autocast(step, torch.bfloat16)
    if policy != "none":
        step = ft.checkpoint(step, policy)
    if k > 1:
        step = ft.accumulate(step, k)
    state = ft.TrainState.create(ft.params_of(model), opt)
    return step, state, lm_batch(rows, length=model.config.seq_len)


# Every (micro-batches, policy) pair on the small model, precision x optimizer cycling through
# all six combinations twice; on the larger one each precision x optimizer once. 18 of the 144
# points of the full grid (benchmarks/memory.py runs all of them).
_MIXES = list(itertools.product(("fp32", "bf16"), OPTIMIZERS))
GRID = [
    ("small", k, policy, *_MIXES[i % 6])
    for i, (k, policy) in enumerate(
        itertools.product((1, 2, 4, 8), ("none", "selective", "blocks"))
    )
] + [
    ("larger", (1, 2, 4, 8, 2, 1)[i], ("none", "selective", "blocks")[i % 3], *mix)
    for i, mix in enumerate(_MIXES)
]


@pytest.mark.parametrize("size,k,policy,precision,opt_name", GRID)
def test_predicted_peak_within_10_percent_of_measured(size, k, policy, precision, opt_name):
    step, state, batch = composed(size, k, policy, precision, opt_name)
    report = ft.memory(step, state, batch)
    measured = peak_bytes(step, state, batch)
    assert abs(report.peak / measured - 1) < 0.10, (report.peak, measured)
    assert report.micro_batches == k


def test_phases_add_up_and_follow_the_transforms():
    step, state, batch = composed("larger", 1, "none", "fp32", "adamw")
    plain = ft.memory(step, state, batch)
    params = sum(t.numel() * 4 for t in ft.tree.leaves(state.params))
    assert plain.params == params and plain.gradients == params
    assert plain.optimizer == optim.state_bytes(state.opt_state)
    assert plain.peak >= plain.params + plain.optimizer + plain.activations
    # fewer bytes saved for backward by checkpointing and by smaller micro-batches
    blocks = ft.memory(ft.checkpoint(step, "blocks"), state, batch)
    selective = ft.memory(ft.checkpoint(step, "selective"), state, batch)
    assert blocks.activations < selective.activations < plain.activations
    four = ft.memory(ft.accumulate(step, 4), state, batch)
    assert four.activations < plain.activations / 3 and four.micro_batches == 4
    # recompute shows in the FLOPs: blocks recompute the blocks' matmuls
    assert blocks.flops > plain.flops == selective.flops
    assert "peak" in str(plain) and "optimizer state" in str(plain)


def test_a_meta_state_and_params_alone_plan_the_same():
    step, state, batch = composed("small", 2, "blocks", "fp32", "adamw")
    real = ft.memory(step, state, batch)
    meta_params = state.params.to("meta")
    meta_batch = {k: v.to("meta") for k, v in batch.items()}
    assert ft.memory(step, meta_params, meta_batch).peak == real.peak
    assert ft.memory(step, state, meta_batch).peak == real.peak


def test_a_users_transform_is_planned_through_its_hooks():
    class KeepACopy(ft.Transform):
        """Keeps a 4 MB buffer shaped by the gradients in state.extra (gradients hook)."""

        def gradients(self, g, state):
            extra = g.extra.clone(recurse=False)
            extra["buffer"] = ft.tree.first_leaf(g.grads).new_zeros(10**6)
            return g._replace(extra=extra)

    step, state, batch = composed("small", 1, "none", "fp32", "adamw")
    base = ft.memory(step, state, batch)
    kept = ft.memory(KeepACopy()(step), state, batch)
    assert kept.peak > base.peak + 3 * 10**6 and kept.peak_phase == "update"
    assert abs(kept.peak / peak_bytes(KeepACopy()(step), state, batch) - 1) < 0.10


def test_the_step_and_state_are_left_alone():
    step, state, batch = composed("small", 2, "selective", "bf16", "adamw")
    before = state.clone()
    ft.memory(step, state, batch)
    assert int(state.step) == 0
    assert all(
        torch.equal(a, b)
        for a, b in zip(ft.tree.leaves(state.params), ft.tree.leaves(before.params))
    )
    with pytest.raises(TypeError, match="expected an ft.Step"):
        ft.memory(lambda s, b: (s, {}), state, batch)


PLAN_7B = textwrap.dedent(
    """
    import json, resource, time, torch
    import ftrain as ft
    from ftrain.models import GPT, GPTConfig
    start = time.perf_counter()
    cfg = GPTConfig(vocab_size=32000, seq_len=2048, d_model=4096, n_layer=32, n_head=32,
                    bias=False, tie_weights=False, matmul="torch")  # 6.7e9 params
    with torch.device("meta"):
        model = GPT(cfg)
    params = ft.params_of(model)
    def loss_fn(params, batch):
        return ft.losses.cross_entropy(ft.apply(model, params, batch["input"]), batch["target"])
    step = ft.train_step(loss_fn, ft.optim.adamw(3e-4), donate=True)
    step = ft.accumulate(ft.checkpoint(ft.autocast(step)), 4)
    batch = {k: torch.empty(8, 2048, dtype=torch.long, device="meta") for k in ("input", "target")}
    report = ft.memory(step, params, batch)
    print(json.dumps(dict(seconds=time.perf_counter() - start, params=ft.param_count(params),
        state=report.state, peak=report.peak,
        rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)))
    """
)


def test_a_7b_plan_takes_under_a_minute_and_2_gib():
    out = subprocess.run(
        [sys.executable, "-c", PLAN_7B], capture_output=True, text=True, timeout=300, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["seconds"] < 60 and got["rss"] < 2 * 2**30, got
    # the hand calculation: fp32 params + grads + AdamW's two moments = 16 bytes a parameter
    assert got["state"] == pytest.approx(16 * got["params"], rel=1e-4)
    assert got["peak"] > got["state"]


# -- under ft.shard, 2 gloo ranks (conftest.py's memory_ranks; fsdp: test_memory_fsdp.py) ------
@pytest.mark.parametrize("config", SHARDED, ids=str)
def test_sharded_peak_within_10_percent_on_each_rank(memory_ranks, config):
    for out in memory_ranks:
        predicted, measured = out["sharded"][config]
        assert abs(predicted / measured - 1) < 0.10, (config, predicted, measured)


# -- where the bytes live: device and host apart (device="cuda" plans on fake tensors) --------
def test_offload_moves_the_optimizer_state_to_the_host_and_nothing_else():
    step, state, batch = composed("small", 1, "none", "fp32", "adamw")
    n = ft.param_count(state.params)
    cpu = ft.memory(step, state, batch)
    assert not cpu.host_apart and cpu.host_peak == 0 and "host == device" in str(cpu)
    # on a CPU plan the host is the device: offload changes no byte
    moved_cpu = ft.memory(ft.offload(step), state, batch)
    assert (moved_cpu.peak, moved_cpu.optimizer) == (cpu.peak, cpu.optimizer)
    plain = ft.memory(step, state, batch, device="cuda")
    moved = ft.memory(ft.offload(step), state, batch, device="cuda")
    small = 1024  # the step's counters (<= 8 elements each) stay real, on the host
    assert plain.params == moved.params == 4 * n and plain.host_params == moved.host_params == 0
    assert abs(plain.optimizer - 8 * n) < small and plain.host_optimizer < small
    assert moved.optimizer == 0 and abs(moved.host_optimizer - 8 * n) < small
    assert plain.state + plain.host_state == moved.state + moved.host_state
    assert moved.host_peak >= moved.host_optimizer + moved.host_update > plain.host_peak
    assert "cuda" in str(moved) and "host" in str(moved)
    # with the gradients too: the device keeps none past the backward
    grads = ft.memory(ft.offload(step, "optimizer+gradients"), state, batch, device="cuda")
    assert grads.gradients == 0 and grads.host_gradients == 4 * n


PLAN_GPT2_XL = dict(vocab_size=50257, seq_len=1024, d_model=1600, n_layer=48, n_head=25)


def test_gpt2_xl_with_adamw_fits_24_gib_of_cuda_only_with_offload():
    from ftrain.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**PLAN_GPT2_XL, matmul="torch"))
    params = ft.params_of(model)
    n = ft.param_count(params)
    # no checkpointing: with ft.checkpoint(step, "blocks") the device's peak is the state and
    # the gradients alone (23.8 GiB: it fits, by the plan, with nothing to spare)
    step = ft.train_step(lm_loss(model), ft.optim.adamw(3e-4), donate=True)
    batch = {k: torch.empty(1, 1024, dtype=torch.long, device="meta") for k in ("input", "target")}
    budget = 24 * 2**30
    on_device = ft.memory(step, params, batch, device="cuda")
    offloaded = ft.memory(ft.offload(step), params, batch, device="cuda")
    # the hand calculation: fp32 params + grads (4 + 4 bytes a parameter) on the device, AdamW's
    # two moments (8) on the device or on the host
    assert on_device.params == offloaded.params == 4 * n
    assert on_device.optimizer == pytest.approx(8 * n, rel=1e-6)
    assert offloaded.host_optimizer == pytest.approx(8 * n, rel=1e-6)
    assert on_device.peak > budget >= offloaded.peak  # 28.0 GiB against 16.4
    assert on_device.peak > 16 * n and offloaded.peak > 8 * n
    # the device's peak falls in backward, so offload saves exactly the state it moves
    assert on_device.peak - offloaded.peak == pytest.approx(8 * n, rel=1e-3)


def test_a_bad_device_is_refused_with_the_legal_forms():
    step, state, batch = composed("small", 1, "none", "fp32", "adamw")
    with pytest.raises(ValueError, match=r"ft.memory\(device='gpu0'\).*'cuda'"):
        ft.memory(step, state, batch, device="gpu0")
    if not torch.cuda.is_available():  # the meta stand-in has no autocast: refused, with the fix
        with pytest.raises(ValueError, match="plan the step in fp32"):
            ft.memory(ft.autocast(step, torch.bfloat16), state, batch, device="cuda")
