"""ft.offload (ftrain.transforms.offload): the same step with the optimizer state on the host.

On a machine without a GPU the host is the device, so the step runs the same kernels on the same
values as the step without offload: the comparisons here are bitwise. In "optimizer+gradients"
mode the gradients are copied into host transfer buffers during backward (the engine's sink,
HostCopies) by the same code as on a GPU; under fsdp each block's reduced shards (the file's
one 2-process run). The CUDA tests (params on the GPU, state and buffers pinned on the host,
copies on a side stream; fsdp on a 1-rank mesh) compare to 1e-6 and skip without a GPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import ftrain as ft
from ftrain.testing import assert_no_recompile, max_rel_error, run_distributed

from _tiny import UNEVEN, assert_trees_close, gpt_step, lm_batch, lm_loss, tiny_gpt

MODES = ("optimizer", "optimizer+gradients")
SHARDS = ("zero2", "fsdp")  # offloaded with the gradients under ft.shard (zero1: the optimizer)


def _adamw():
    # torch's fused kernel (fused=None picks it for CPU leaves), a mask and clipping in the chain
    return ft.optim.chain(
        ft.optim.clip_by_global_norm(1.0),
        ft.optim.adamw(1e-2, weight_decay=0.1, mask=ft.optim.decay_mask),
    )


def _train(step, state, steps=3, start=0):
    for i in range(start, start + steps):
        state, metrics = step(state, lm_batch(8, seed=i, lengths=UNEVEN))
    return state, metrics


def _on_host(state) -> bool:
    return all(t.device == torch.device("cpu") for t in ft.tree.leaves(state.opt_state))


def _sink(step):
    """The transfer buffers' owner of an offloaded step (None where its engine has no sink)."""
    return getattr(step.resolved.gradient_engine, "sink", None)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("donate", [False, True])
def test_offload_equals_the_step_without_it(mode, donate):
    model, _, state = gpt_step(_adamw())
    step = ft.train_step(lm_loss(model), _adamw(), donate=donate)
    kept = state.clone()
    want, m_want = _train(step, state.clone())
    got, m_got = _train(ft.offload(step, mode), state.clone())
    assert_trees_close(got, want, 0)  # params, optimizer state, step, rng: bitwise
    for k in m_want:
        assert torch.equal(m_got[k], m_want[k]), k
    assert _on_host(got)
    if not donate:  # the input state is left as it was
        offloaded = ft.offload(step, mode)
        offloaded(kept, lm_batch(8, lengths=UNEVEN))
        assert_trees_close(kept, state, 0)


def test_offload_composes_with_accumulate_checkpoint_and_autocast():
    model, _, state = gpt_step(_adamw(), dropout=0.1)
    step = ft.train_step(lm_loss(model), _adamw())
    composed = ft.accumulate(ft.checkpoint(ft.autocast(step, torch.bfloat16)), 3)
    want, _ = _train(composed, state)
    inner = ft.offload(step, "optimizer+gradients")
    for offloaded in (  # offload outside the others, and innermost
        ft.offload(composed, "optimizer+gradients"),
        ft.accumulate(ft.checkpoint(ft.autocast(inner, torch.bfloat16)), 3),
    ):
        got, _ = _train(offloaded, state)
        assert_trees_close(got, want, 0)
        # the gradients went through the transfer buffers during backward, one per param
        assert len(_sink(offloaded).buffers) == len(ft.tree.leaves(state.params))


@pytest.mark.parametrize("k", [1, 2])
def test_under_fp16_loss_scaling_the_gradients_are_copied_during_backward_too(k):
    """A loss scale reweights each micro-batch (the mean times the scale backpropagated, the
    gradients times the count): the sink gets them multiplied as they are handed over, the same
    values as without offload, bitwise."""
    model, _, state = gpt_step(_adamw())
    step = ft.accumulate(ft.autocast(ft.train_step(lm_loss(model), _adamw()), torch.float16), k)
    state = step.init_extra(state)
    want, m_want = _train(step, state)
    offloaded = ft.offload(step, "optimizer+gradients")
    got, m_got = _train(offloaded, state)
    assert_trees_close(got, want, 0)
    assert torch.equal(m_got["grad_norm"], m_want["grad_norm"])
    assert len(_sink(offloaded).buffers) == len(ft.tree.leaves(state.params))


class _Chain(nn.Module):
    """Four tanh(Linear) blocks; ``mark`` runs when backward reaches the earliest block (the
    identity after block 0 is differentiated after blocks 1-3, before block 0)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x, mark):
        for i, block in enumerate(self.blocks):
            x = torch.tanh(block(x))
            if i == 0 and mark is not None:
                x = _Mark.apply(x, mark)
        return x


class _Mark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mark):
        ctx.mark = mark
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.mark()
        return g, None


@pytest.mark.parametrize("k", [1, 2])
def test_each_gradient_is_copied_to_the_host_during_backward_as_soon_as_it_is_final(k):
    torch.manual_seed(0)
    model = _Chain()
    snapshots = []  # the transfer buffers when backward reaches block 0, per micro-batch
    rows = torch.randn(4, 6)

    def loss_fn(params, batch, mark=None):
        out = ft.apply(model, params, batch, mark)  # (rows, 6)
        return ft.Loss(out.square().sum(), torch.tensor(float(out.numel())))

    opt = ft.optim.sgd(0.1)
    plain = ft.accumulate(ft.train_step(loss_fn, opt), k)
    sink_of = []

    def marked(params, batch):
        mark = lambda: snapshots.append([b.clone() for b in _sink(sink_of[0]).buffers])  # noqa: E731
        return loss_fn(params, batch, mark)

    offloaded = ft.offload(ft.accumulate(ft.train_step(marked, opt), k), "optimizer+gradients")
    sink_of.append(offloaded)
    state = ft.TrainState.create(ft.params_of(model), opt)
    want, _ = plain(state, rows)
    got, _ = offloaded(state, rows)
    assert_trees_close(got, want, 0)  # the step without offload, bitwise
    # the reference, computed another way: torch.autograd.grad of each micro-batch's summed loss
    # on the model's own params, added in micro-batch order (what the buffers hold, undivided)
    params = list(model.parameters())
    ref = None
    for piece in rows.chunk(k):
        g = torch.autograd.grad(model(piece, None).square().sum(), params)
        ref = g if ref is None else [a + b for a, b in zip(ref, g)]
    final = _sink(offloaded).buffers
    assert [tuple(b.shape) for b in final] == [tuple(p.shape) for p in params]
    for b, r in zip(final, ref):
        assert torch.equal(b, r)
    # when backward reached block 0 in the last micro-batch, blocks 1-3 were copied already
    # (params 2..7, in the params' order) and block 0's weight and bias were not (no buffer yet)
    early = snapshots[-1]
    assert len(snapshots) == k and len(early) == len(params)
    for i in range(2, len(params)):
        assert torch.equal(early[i], ref[i]), i
    assert early[0].numel() == early[1].numel() == 0


def test_offload_under_compile_runs_the_update_eagerly_and_does_not_recompile():
    model, step, state = gpt_step(n_layer=1)  # SGD with momentum: linear in the gradients
    want, m_want = _train(step, state, steps=2)
    compiled = ft.compile(ft.offload(step, "optimizer+gradients"), backend="aot_eager")
    batches = [lm_batch(8, seed=i, lengths=UNEVEN) for i in range(2)]
    got, metrics = assert_no_recompile(compiled, state, batches)
    m_got = metrics[-1]
    # the forward and backward are compiled (rounding differs); the update is torch's fused SGD,
    # run eagerly (had it been traced, the graph would hold the chain's ops instead)
    assert max_rel_error(m_got["loss"], m_want["loss"]) < 1e-5
    for a, b in zip(ft.tree.leaves(got.params), ft.tree.leaves(want.params)):
        assert max_rel_error(a, b) < 1e-5
    # torch's fused kernel ran: a traced update would be the chain's ops (ftrain.optim refuses
    # the fused op while dynamo traces), so the update ran outside the graph
    with torch.profiler.profile() as prof:
        compiled(got, batches[0])
    assert any("_fused_sgd" in e.key for e in prof.key_averages())


def test_an_offloaded_state_saves_and_resumes(tmp_path):
    model, _, state = gpt_step(_adamw())
    step = ft.offload(ft.train_step(lm_loss(model), _adamw(), donate=True))
    mid, _ = _train(step, state.clone(), steps=2)
    ft.save(mid, tmp_path / "ckpt")
    loaded = ft.load(tmp_path / "ckpt", like=mid)
    assert _on_host(loaded)
    assert_trees_close(loaded, mid, 0)
    resumed, _ = _train(step, loaded, steps=1, start=2)
    straight, _ = _train(step, mid, steps=1, start=2)
    assert_trees_close(resumed, straight, 0)


def test_bad_mode_and_offloading_twice_are_refused():
    _, step, _ = gpt_step()
    with pytest.raises(ValueError, match=r"ft\.offload\(step, mode='gradients'\): unknown mode"):
        ft.offload(step, "gradients")
    with pytest.raises(ValueError, match="ft.offload was applied twice"):
        ft.offload(ft.offload(step), "optimizer+gradients")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (params there)")
def test_on_cuda_the_state_is_pinned_on_the_host_and_the_step_is_unchanged():
    model = tiny_gpt().cuda()
    opt = ft.optim.adamw(1e-2, weight_decay=0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)
    step = ft.train_step(lm_loss(model), opt)
    cuda = {k: v.cuda() for k, v in lm_batch(8, lengths=UNEVEN).items()}
    want, _ = step(state, cuda)
    got, _ = ft.offload(step, "optimizer+gradients")(state, cuda)
    assert _on_host(got) and all(t.is_pinned() for t in ft.tree.leaves(got.opt_state))
    assert all(t.is_cuda for t in ft.tree.leaves(got.params))
    for a, b in zip(ft.tree.leaves(got.params), ft.tree.leaves(want.params)):
        assert max_rel_error(a, b) < 1e-6


LR = 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (params there)")
def test_on_cuda_gradients_are_copied_on_a_side_stream_into_pinned_buffers_reused_each_step():
    model = tiny_gpt().cuda()
    opt = ft.optim.adamw(LR, weight_decay=0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)
    # donated: the new params are written into the pinned staging buffers and copied back from
    # them asynchronously, and the next step copies the params into the same buffers
    step = ft.accumulate(ft.train_step(lm_loss(model), opt, donate=True), 2)
    offloaded = ft.offload(step, "optimizer+gradients")
    got = state.clone()
    for i in range(3):
        cuda = {k: v.cuda() for k, v in lm_batch(8, seed=i, lengths=UNEVEN).items()}
        # each step against the device's step from the same state (over several steps Adam's
        # normalisation magnifies rounding differences where a gradient is near 0). The host's
        # fused AdamW and the device's differ by their bias corrections' rounding: 1 - 0.999**t
        # in fp32 is off by up to 6e-8 / 0.002 = 3e-5 relative at t = 2, so each update (at most
        # ~3 lr early on) by up to 1e-4 lr; a wrong gradient would move a param by ~lr
        copy = got.clone()  # the step below donates it
        want, _ = step(copy.replace(opt_state=copy.opt_state.to("cuda")), cuda)
        got, _ = offloaded(got, cuda)
        for a, b in zip(ft.tree.leaves(got.params), ft.tree.leaves(want.params)):
            assert (a - b).abs().max() <= 1e-4 * LR
        sink = _sink(offloaded)
        if i == 0:
            first = [b.data_ptr() for b in sink.buffers]
    assert len(sink.buffers) == len(ft.tree.leaves(state.params))
    assert all(b.is_pinned() and b.device.type == "cpu" for b in sink.buffers)
    assert [b.data_ptr() for b in sink.buffers] == first  # allocated once, reused
    assert list(sink.streams) == [torch.device("cuda", torch.cuda.current_device())]


def _fsdp_on_cuda(backend: str) -> dict:
    """One process, fsdp over a 1-rank mesh of ``backend`` on this GPU, with and without offload."""
    from torch.distributed.device_mesh import DeviceMesh

    from ftrain.distributed import shard_state

    mesh = DeviceMesh.from_group(torch.distributed.new_group([0], backend=backend), "cuda")
    model = tiny_gpt().cuda()
    opt = ft.optim.adamw(1e-2, weight_decay=0.1)
    step = ft.train_step(lm_loss(model), opt)
    plain = ft.shard(step, "fsdp", mesh=mesh)
    off = ft.shard(ft.offload(step, "optimizer+gradients"), "fsdp", mesh=mesh)
    want = got = shard_state(ft.TrainState.create(ft.params_of(model), opt), "fsdp", mesh=mesh)
    for i in range(2):
        cuda = {k: v.cuda() for k, v in lm_batch(8, seed=i, lengths=UNEVEN).items()}
        want, _ = plain(want, cuda)
        got, _ = off(got, cuda)
    pairs = zip(ft.tree.leaves(got.params), ft.tree.leaves(want.params))
    sink = _sink(off)
    return {
        "error": max(max_rel_error(a.to_local(), b.to_local()) for a, b in pairs),
        "buffers": [(b.is_pinned(), b.device.type) for b in sink.buffers],
        "streams": [d.type for d in sink.streams],
        "params": len(ft.tree.leaves(got.params)),
    }


def _fsdp_on_cuda_both() -> dict:
    out = {"cpu:gloo,cuda:nccl": _fsdp_on_cuda("cpu:gloo,cuda:nccl")}
    try:  # NCCL alone: the host update could not reduce its shards' norms
        out["nccl"] = _fsdp_on_cuda("nccl")
    except ValueError as e:
        out["nccl"] = str(e)
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL, the shards)")
def test_on_cuda_under_fsdp_each_gradient_shard_is_copied_on_a_side_stream_into_pinned_memory():
    (out,) = run_distributed(_fsdp_on_cuda_both, world_size=1)
    both, nccl = out["cpu:gloo,cuda:nccl"], out["nccl"]
    assert both["error"] < 1e-6  # fsdp without offload
    # a group that reduces host tensors too: each shard copied in backward
    assert both["buffers"] == [(True, "cpu")] * both["params"] and both["streams"] == ["cuda"]
    # NCCL alone: refused at the first call (the host update reduces its shards' norms)
    assert nccl.startswith("ft.offload: the optimizer state is split over a 'nccl'")


# -- each rank offloads its own shards ---------------------------------------------------------


def _sharded_runs() -> dict:
    from ftrain.distributed import shard_state, unshard_state

    rank = torch.distributed.get_rank()
    out = {}
    for strategy, mode in (("zero1", "optimizer"), *((s, "optimizer+gradients") for s in SHARDS)):
        for off in (False, True):
            model = tiny_gpt(seq_len=8, n_head=2, bias=False)
            step = ft.train_step(lm_loss(model), _adamw(), donate=True)
            step = ft.shard(ft.offload(step, mode) if off else step, strategy)
            state = ft.TrainState.create(ft.params_of(model), _adamw())
            state = shard_state(state, strategy)
            for i in range(2):
                batch = lm_batch(4, seed=i, lengths=(2, 5, 8, 8), length=8)
                state, _ = step(state, {k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()})
            whole = unshard_state(state)
            out[strategy, off] = {
                "state": {
                    p: t.clone() for p, t in zip(ft.tree.paths(whole), ft.tree.leaves(whole))
                },
                "sharded": any(hasattr(t, "placements") for t in ft.tree.leaves(state.opt_state)),
                "sink": _sink(step) is not None,
            }
    out["chain"] = {prefetch: _chain_under_fsdp(rank, prefetch) for prefetch in (True, False)}
    out["buckets"] = {strategy: _chain_in_buckets(rank, strategy) for strategy in ("ddp", "zero2")}
    out["nccl only"] = _on_an_nccl_only_group(rank)
    return out


def _on_an_nccl_only_group(rank: int) -> str | None:
    """The error of an offloaded zero2 step whose group says it runs NCCL alone (the backend's
    name stubbed on this gloo group: the refusal comes before any collective)."""
    from unittest import mock

    from ftrain.distributed import shard_state

    model = tiny_gpt(seq_len=8, n_head=2, bias=False)
    step = ft.shard(ft.offload(ft.train_step(lm_loss(model), _adamw())), "zero2")
    state = shard_state(ft.TrainState.create(ft.params_of(model), _adamw()), "zero2")
    batch = {k: v[2 * rank : 2 * rank + 2] for k, v in lm_batch(4, length=8).items()}
    with mock.patch.object(torch.distributed, "get_backend", lambda group=None: "nccl"):
        try:
            step(state, batch)
        except ValueError as e:
            return str(e)
    return None


class _Headed(_Chain):
    """_Chain and a head outside the blocks (its params, 8 and 9, gathered by the root)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(6, 6)

    def forward(self, x, mark):
        return self.head(super().forward(x, mark))


def _marked(rank: int):
    """_Headed, this rank's 4 of 8 rows, its loss function, and the same loss function marking
    when the last backward reaches block 0: a snapshot then of the sink buffers of the step put
    in ``holder`` (returned with the snapshots' list)."""
    torch.manual_seed(0)
    model, rows = _Headed(), torch.randn(8, 6)[4 * rank : 4 * rank + 4]
    snapshots, holder = [], []

    def loss_fn(params, batch, mark=None):
        out = ft.apply(model, params, batch, mark)
        return ft.Loss(out.square().sum(), torch.tensor(float(out.numel())))

    def marked(params, batch):
        mark = lambda: snapshots.append([b.clone() for b in _sink(holder[0]).buffers])  # noqa: E731
        return loss_fn(params, batch, mark)

    return model, rows, loss_fn, marked, snapshots, holder


def _buffers_against(got, want, step, snapshots, ref) -> dict:
    """What the chain tests compare: the two states equal, the sink's buffers at the end and
    when backward reached block 0, and the reference gradients."""
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(ft.tree.leaves(got), ft.tree.leaves(want))),
        "final": [b.clone() for b in _sink(step).buffers],
        "early": snapshots[-1],
        "ref": ref,
    }


def _chain_under_fsdp(rank: int, prefetch: bool) -> dict:
    """_Headed under fsdp (2 micro-batches of this rank's 4 rows), with and without offload; the
    host buffers when the last backward reaches block 0, and the reference: each micro-batch's
    gradient summed over the ranks (all-reduce), this rank's rows, added in micro-batch order."""
    from ftrain.distributed import shard_state, unshard_state

    model, rows, loss_fn, marked, snapshots, holder = _marked(rank)
    opt = ft.optim.sgd(0.1)

    plain = ft.shard(ft.accumulate(ft.train_step(loss_fn, opt), 2), "fsdp", prefetch=prefetch)
    off = ft.offload(ft.accumulate(ft.train_step(marked, opt), 2), "optimizer+gradients")
    holder.append(ft.shard(off, "fsdp", prefetch=prefetch))
    state = shard_state(ft.TrainState.create(ft.params_of(model), opt), "fsdp")
    want, got = unshard_state(plain(state, rows)[0]), unshard_state(holder[0](state, rows)[0])
    params, ref = list(model.parameters()), None
    for piece in rows.chunk(2):
        g = list(torch.autograd.grad(model(piece, None).square().sum(), params))
        for t in g:
            torch.distributed.all_reduce(t)
        g = [t.chunk(2)[rank] for t in g]
        ref = g if ref is None else [a + b for a, b in zip(ref, g)]
    return _buffers_against(got, want, holder[0], snapshots, ref)


def _chain_in_buckets(rank: int, strategy: str) -> dict:
    """_Headed under ddp or zero2, reduced during backward in buckets of one param each (2
    micro-batches of this rank's 4 rows), with and without offload (the latter reduced after
    backward); the host buffers when the last backward reaches block 0, and the reference: this
    rank's micro-batches' gradients added, then summed over the ranks (zero2: this rank's rows)."""
    from ftrain.distributed import shard_state, unshard_state

    model, rows, loss_fn, marked, snapshots, holder = _marked(rank)
    opt = ft.optim.sgd(0.1)

    plain = ft.shard(ft.accumulate(ft.train_step(loss_fn, opt), 2), strategy, bucket_mb=None)
    off = ft.offload(ft.accumulate(ft.train_step(marked, opt), 2), "optimizer+gradients")
    holder.append(ft.shard(off, strategy, bucket_mb=1e-6))  # a bucket per param
    state = shard_state(ft.TrainState.create(ft.params_of(model), opt), strategy)
    want, got = unshard_state(plain(state, rows)[0]), unshard_state(holder[0](state, rows)[0])
    params, ref = list(model.parameters()), None
    for piece in rows.chunk(2):
        g = list(torch.autograd.grad(model(piece, None).square().sum(), params))
        ref = g if ref is None else [a + b for a, b in zip(ref, g)]
    for t in ref:
        torch.distributed.all_reduce(t)
    if strategy == "zero2":
        ref = [t.chunk(2)[rank] for t in ref]
    return _buffers_against(got, want, holder[0], snapshots, ref)


@pytest.fixture(scope="module")
def sharded_runs():
    """The file's one 2-process run (both tests below read it)."""
    return run_distributed(_sharded_runs, world_size=2)


def test_a_state_split_over_an_nccl_only_group_is_refused_with_the_fix(sharded_runs):
    """The host update reduces its shards' norms (clipping) on the host: NCCL alone cannot."""
    for out in sharded_runs:
        assert out["nccl only"] is not None
        assert out["nccl only"].startswith("ft.offload: the optimizer state is split over a 'nccl'")
        assert "ft.distributed.init(backend='cpu:gloo,cuda:nccl')" in out["nccl only"]


def test_under_shard_each_rank_offloads_its_own_shards(sharded_runs):
    ranks = sharded_runs
    for strategy in ("zero1", "zero2", "fsdp"):
        plain, off = ranks[0][strategy, False], ranks[0][strategy, True]
        assert off["sharded"], strategy  # still laid out over the ranks
        if strategy != "zero1":  # copied in backward: per bucket, per block (below)
            assert off["sink"], strategy
        assert plain["state"].keys() == off["state"].keys()
        for path, t in plain["state"].items():
            assert torch.equal(off["state"][path], t), (strategy, path)


def test_under_fsdp_each_blocks_gradient_shard_is_copied_once_reduced_during_backward(
    sharded_runs,
):
    for (rank, out), prefetch in itertools.product(enumerate(sharded_runs), (True, False)):
        chain = out["chain"][prefetch]
        assert chain["equal"], rank  # fsdp without offload, bitwise
        ref, final, early = chain["ref"], chain["final"], chain["early"]
        assert [b.shape for b in final] == [r.shape for r in ref]  # this rank's shards only
        for i, (b, r) in enumerate(zip(final, ref)):
            assert torch.equal(b, r), (rank, i)
        # when the last backward reached block 0, blocks 2 and 3 (params 4..7) were reduced and
        # copied (with prefetch block 1's reduce-scatter was in flight; without, it was done and
        # copied too), block 0 and the head not (the root's params: reduced last)
        assert len(ref) == 10 and len(early) == 8  # the head's (8, 9): not handed over yet
        for i in range(4 if prefetch else 2, 8):
            assert torch.equal(early[i], ref[i]), (rank, prefetch, i)
        assert early[0].numel() == early[1].numel() == 0, rank


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_under_ddp_and_zero2_each_bucket_is_reduced_and_copied_during_backward(
    sharded_runs, strategy
):
    """The buckets' collectives run during backward, not after it: when the last backward
    reaches block 0, the head's and blocks 2-3's gradients (params 4..9, the first buckets) are
    summed over the ranks and in their host buffers, a bucket behind the reduction; block 0's
    (params 0, 1) are not handed over yet."""
    for rank, out in enumerate(sharded_runs):
        chain = out["buckets"][strategy]
        assert chain["equal"], rank  # the step reduced after backward, without offload, bitwise
        ref, final, early = chain["ref"], chain["final"], chain["early"]
        assert [b.shape for b in final] == [r.shape for r in ref]  # zero2: this rank's rows
        for i, (b, r) in enumerate(zip(final, ref)):
            assert torch.equal(b, r), (rank, i)
        assert len(early) == len(ref) == 10
        for i in range(4, 10):
            assert torch.equal(early[i], ref[i]), (rank, strategy, i)
        assert early[0].numel() == early[1].numel() == 0, rank


def test_explain_lists_offload_at_the_gradients_hook_only_in_the_mode_that_acts_there():
    model = tiny_gpt()
    step = ft.train_step(lm_loss(model), ft.optim.adamw(1e-3))

    def at_gradients(s) -> str:
        return next(r for r in s.explain().splitlines() if r.split()[1:2] == ["gradients"])

    assert at_gradients(ft.offload(step)).split()[-1] == "-"
    assert at_gradients(ft.offload(step, "optimizer+gradients")).split()[-1] == "offload"
    assert _sink(ft.offload(step)) is None
    # an engine that replaces the default one drops the sink (the same gradients), either order
    clipped = ft.dp_sgd(ft.offload(step, "optimizer+gradients"), 1.0, 0.0)
    assert _sink(clipped) is None and _sink(ft.offload(ft.dp_sgd(step, 1.0, 0.0))) is None
    with pytest.raises(ValueError, match="offload_transform"):
        ft.transforms.Offload("optimizer+gradients")


def test_updates_return_to_the_params_device_when_the_gradients_are_on_the_host():
    # ZeRO's and fsdp's optimizers add the offloaded update to the device params themselves; under
    # "optimizer+gradients" the grads reach it on the host. Fake CUDA params: no GPU needed.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ftrain.transforms.offload import offloaded

    opt = offloaded(ft.optim.sgd(0.1, momentum=0.9))  # adamw reads its step count on the host
    with FakeTensorMode():
        params = TensorDict(w=torch.empty(4, 3, device="cuda"), b=torch.empty(3, device="cuda"))
        grads = params.apply(lambda t: torch.empty(t.shape), device="cpu")  # on the host
        state = opt.init(params)
        updates, new_state = opt.update(grads, state, params)
        alone, _ = opt.update(grads, state)  # no params: where the grads are
    assert {t.device.type for t in ft.tree.leaves(updates)} == {"cuda"}
    assert {t.device.type for t in ft.tree.leaves(alone)} == {"cpu"}
    assert {t.device.type for t in ft.tree.leaves(new_state)} == {"cpu"}
