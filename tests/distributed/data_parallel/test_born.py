"""ftrain.distributed.data_parallel.born: a state born as this process's shards equals, bitwise,
the whole model built after ``torch.manual_seed(seed)`` and then sharded by ``ft.shard_state``;
its peak host memory is about one shard, not the model.

The replay itself is checked in this process against modules built whole (fast); the sharded
layout and the bytes per rank on 2 gloo processes (one ``run_distributed`` call).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ftrain as ft
from ftrain import tree
from ftrain.distributed import local_bytes, shard_state, sharded_init
from ftrain.distributed.data_parallel.born import record_init
from ftrain.distributed.dtensor import is_dtensor, local
from ftrain.models import GPT, GPTConfig
from ftrain.testing import run_distributed, track_allocations

SEED = 7


def _config(**kw) -> GPTConfig:
    return GPTConfig(**{"vocab_size": 33, "seq_len": 8, "d_model": 16, "n_layer": 2, "n_head": 2,
                        "matmul": "torch", **kw})  # fmt: skip


BUILDS = {
    "gpt": lambda: GPT(_config()),
    "gpt_moe_untied_nobias": lambda: GPT(_config(n_experts=2, tie_weights=False, bias=False)),
    "torch_layers": lambda: nn.Sequential(
        nn.Linear(5, 7), nn.LayerNorm(7), nn.Embedding(9, 7, padding_idx=2), nn.Conv1d(3, 4, 2)
    ),
}


def _replayed(record, seed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return record.replay(lambda name, whole: whole.clone())


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_replay_equals_the_model_built_whole(name):
    """Every parameter bitwise equal to the module built whole after manual_seed, the global
    random state untouched."""
    build = BUILDS[name]
    torch.manual_seed(SEED)
    whole = dict(build().named_parameters())
    record = record_init(build)
    assert all(p.is_meta for p in record.params.values())
    before = torch.get_rng_state()
    got = _replayed(record, SEED)
    assert torch.equal(torch.get_rng_state(), before)
    assert list(got) == list(whole)
    assert [n for n in whole if not torch.equal(got[n], whole[n].detach())] == []
    assert not torch.equal(got[next(iter(got))], _replayed(record, SEED + 1)[next(iter(got))])


def test_meta_module_gets_its_reset_parameters_or_the_given_init():
    with torch.device("meta"):
        template = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7))

    def init(name, p):
        nn.init.xavier_uniform_(p) if p.dim() > 1 else nn.init.normal_(p, 1.0, 0.5)

    for given in (None, init):
        got = _replayed(record_init(template, given), SEED)
        whole = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7))
        torch.manual_seed(SEED)
        if given is None:
            for m in whole:
                m.reset_parameters()
        else:
            for n, p in whole.named_parameters():
                init(n, p.data)
        for n, p in whole.named_parameters():
            assert torch.equal(got[n], p.detach()), (given, n)


class _Blank(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))


class _OwnGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(3).normal_(generator=torch.Generator().manual_seed(0)))


class _OnCPU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, device="cpu"))


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (_Blank, "never given a value"),
        (_OwnGenerator, "Generator of its own"),
        (_OnCPU, "not on meta"),
    ],
)
def test_what_cannot_be_replayed_exactly_is_refused(build, words):
    with pytest.raises(ValueError, match=words):
        record_init(build)


def test_bad_arguments_are_refused_before_any_work():
    with pytest.raises(ValueError, match="unknown strategy"):
        sharded_init(BUILDS["gpt"], ft.optim.adamw(1e-3), "fdsp")


def _adamw():
    return ft.optim.adamw(1e-3, weight_decay=0.1)


def _layout(t):
    return (type(t).__name__, tuple(t.placements) if is_dtensor(t) else None, tuple(t.shape))


def _differences(a, b) -> list[str]:
    """Keys whose layout or local values differ between two states (bitwise)."""
    out = []
    for field in ("params", "opt_state", "extra"):
        fa, fb = tree.to_flat(getattr(a, field)), tree.to_flat(getattr(b, field))
        if list(fa) != list(fb):
            return [f"{field} keys {list(fa)} != {list(fb)}"]
        for k in fa:
            x, y = fa[k], fb[k]
            if _layout(x) != _layout(y):
                out.append(f"{field}.{k} layout")
            elif not torch.equal(
                local(x) if is_dtensor(x) else x, local(y) if is_dtensor(y) else y
            ):
                out.append(f"{field}.{k} values")
    if int(a.step) != int(b.step) or int(a.rng) != int(b.rng):
        out.append("step/rng")
    return out


def _big():
    # 16 blocks: the largest parameter whole is a small part of one rank's shard
    return GPT(_config(n_layer=16, d_model=32, vocab_size=65))


def _on_each_rank():
    out = {}
    for strategy in ("fsdp", "zero2"):
        torch.manual_seed(SEED)
        whole = ft.TrainState.create(ft.params_of(BUILDS["gpt"]()), _adamw(), seed=SEED)
        reference = shard_state(whole, strategy)
        born = sharded_init(BUILDS["gpt"], _adamw(), strategy, seed=SEED)
        out[strategy] = _differences(born, reference)
    wte = sharded_init(BUILDS["gpt"], _adamw(), seed=SEED + 1).params["wte", "weight"]
    out["rows"] = (local(wte).clone(), wte.shape[0])
    sgd = ft.optim.sgd(0.1)  # no optimizer state: a rank's shard is its rows of the params
    with track_allocations() as mem:
        born = sharded_init(_big, sgd, "fsdp", seed=SEED)
    out["born_peak"], out["shard"] = mem.peak, local_bytes(born)
    with track_allocations() as mem:  # the way without: build whole, then keep this rank's rows
        torch.manual_seed(SEED)
        whole = ft.TrainState.create(ft.params_of(_big()), sgd, seed=SEED)
        shard_state(whole, "fsdp")
        del whole
    out["whole_peak"] = mem.peak
    out["model_bytes"] = sum(p.numel() * 4 for p in _big().parameters())
    return out


@pytest.fixture(scope="module")
def two_rank_results():
    return run_distributed(_on_each_rank, 2)


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_born_equals_built_whole_then_sharded_bitwise(two_rank_results, strategy):
    for rank in two_rank_results:
        assert rank[strategy] == []


def test_the_two_ranks_hold_different_rows_of_another_seed(two_rank_results):
    (a, rows), (b, _) = (r["rows"] for r in two_rank_results)
    assert a.shape[0] + b.shape[0] == rows
    assert not torch.equal(a[: b.shape[0]], b)


def test_peak_host_bytes_while_born_is_about_one_shard(two_rank_results):
    """With 2 ranks and plain SGD a rank's fsdp shard is half the params. Born sharded, the
    creation peaks within 1.2x of the shard; built whole (the module, its params_of copy), it
    peaks at about 4x the shard, so the bound catches any whole materialisation."""
    for r in two_rank_results:
        assert r["born_peak"] <= 1.2 * r["shard"], (r["born_peak"], r["shard"])
        assert r["whole_peak"] >= 2 * r["model_bytes"] > 3.9 * r["shard"]
