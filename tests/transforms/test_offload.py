"""ft.offload (ftrain.transforms.offload): the same step with the optimizer state on the host.

On a machine without a GPU the host is the device, so the step runs the same kernels on the same
values as the step without offload: the comparisons here are bitwise. The CUDA test (params on
the GPU, state on the host) compares to 1e-6 and skips without a GPU.
"""

from __future__ import annotations

import pytest
import torch

import ftrain as ft
from ftrain.testing import assert_no_recompile, max_rel_error, run_distributed

from _tiny import UNEVEN, assert_trees_close, gpt_step, lm_batch, lm_loss, tiny_gpt

MODES = ("optimizer", "optimizer+gradients")


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


def test_offload_under_compile_runs_the_update_eagerly_and_does_not_recompile():
    model, step, state = gpt_step()  # SGD with momentum: linear in the gradients
    want, m_want = _train(step, state, steps=2)
    compiled = ft.compile(ft.offload(step, "optimizer+gradients"))
    batches = [lm_batch(8, seed=i, lengths=UNEVEN) for i in range(2)]
    got, metrics = assert_no_recompile(compiled, state, batches)
    m_got = metrics[-1]
    # the forward and backward are compiled (rounding differs); the update is torch's fused SGD,
    # run eagerly (inductor would have generated its own)
    assert max_rel_error(m_got["loss"], m_want["loss"]) < 1e-5
    for a, b in zip(ft.tree.leaves(got.params), ft.tree.leaves(want.params)):
        assert max_rel_error(a, b) < 1e-5
    # torch's fused kernel ran: a compiled update would be inductor's (ftrain.optim refuses the
    # fused op while dynamo traces), so the update ran outside the graph
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


# -- each rank offloads its own shards ---------------------------------------------------------


def _sharded_runs() -> dict:
    from ftrain.distributed import shard_state, unshard_state

    rank = torch.distributed.get_rank()
    out = {}
    for strategy in ("zero1", "zero2", "fsdp"):
        for off in (False, True):
            model = tiny_gpt(seq_len=8, n_head=2, bias=False)
            step = ft.train_step(lm_loss(model), _adamw(), donate=True)
            step = ft.shard(ft.offload(step) if off else step, strategy)
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
            }
    return out


def test_under_shard_each_rank_offloads_its_own_shards():
    ranks = run_distributed(_sharded_runs, world_size=2)
    for strategy in ("zero1", "zero2", "fsdp"):
        plain, off = ranks[0][strategy, False], ranks[0][strategy, True]
        assert off["sharded"], strategy  # still laid out over the ranks
        assert plain["state"].keys() == off["state"].keys()
        for path, t in plain["state"].items():
            assert torch.equal(off["state"][path], t), (strategy, path)


def test_explain_lists_offload_at_the_gradients_hook_only_in_the_mode_that_acts_there():
    model = tiny_gpt()
    step = ft.train_step(lm_loss(model), ft.optim.adamw(1e-3))

    def at_gradients(s) -> str:
        return next(r for r in s.explain().splitlines() if r.split()[1:2] == ["gradients"])

    assert at_gradients(ft.offload(step)).split()[-1] == "-"
    assert at_gradients(ft.offload(step, "optimizer+gradients")).split()[-1] == "offload"
    with pytest.raises(ValueError, match="offload_transform"):
        ft.transforms.Offload("optimizer+gradients")
