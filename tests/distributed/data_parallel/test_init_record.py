"""ftrain.distributed.data_parallel.init_record: a model built on meta, its value-writing ops
replayed on the CPU, gets bitwise the params of the model built whole after
``torch.manual_seed(seed)``; what a replay could not reproduce is refused when recorded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ftrain.distributed.data_parallel.init_record import record_init
from ftrain.models import GPT, GPTConfig

SEED = 7


def _config(**kw) -> GPTConfig:
    return GPTConfig(**{"vocab_size": 33, "seq_len": 8, "d_model": 16, "n_layer": 2, "n_head": 2,
                        "matmul": "torch", **kw})  # fmt: skip


def _torch_inits():
    """nn.init's four that return at once on a meta tensor, each after a draw it overwrites."""
    m = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3), nn.Conv1d(4, 4, 3), nn.Linear(5, 5))
    nn.init.orthogonal_(m[0].weight, gain=2.0)
    nn.init.trunc_normal_(m[1].weight, std=0.3, a=-0.4)
    nn.init.trunc_normal_(m[1].bias)
    nn.init.dirac_(m[2].weight)
    nn.init.sparse_(m[3].weight, 0.5)
    return m


BUILDS = {
    "torch_inits_that_skip_meta": _torch_inits,
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


class _Reseeds(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.w = nn.Linear(2, 2)


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
        (_Reseeds, "sets the global generator's state"),
    ],
)
def test_what_cannot_be_replayed_exactly_is_refused(build, words):
    with pytest.raises(ValueError, match=words):
        record_init(build)


def test_init_runs_after_a_builders_constructor():
    def init(name, p):
        nn.init.trunc_normal_(p, std=0.05) if p.dim() > 1 else nn.init.uniform_(p)

    build = BUILDS["gpt"]
    got = _replayed(record_init(build, init), SEED)
    torch.manual_seed(SEED)
    whole = build()
    for n, p in whole.named_parameters():
        init(n, p.data)
    assert [n for n, p in whole.named_parameters() if not torch.equal(got[n], p.detach())] == []
