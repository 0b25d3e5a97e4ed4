"""ftrain.optim's building blocks (ftrain/optim/transforms.py) against the same steps done by
hand."""

from __future__ import annotations

import pytest
import torch

from ftrain import optim

from _optim import params_and_grads
from _tiny import flat


def test_clip_by_global_norm():
    params, grads = params_and_grads()
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values(True, True)]))
    opt = optim.clip_by_global_norm(float(norm) / 4)
    clipped, _ = opt.update(grads, opt.init(params))
    got = torch.linalg.vector_norm(torch.cat([g.flatten() for g in clipped.values(True, True)]))
    assert abs(float(got) - float(norm) / 4) <= 1e-6 * float(norm)
    for k, g in flat(clipped).items():  # same direction
        assert torch.allclose(g * 4, flat(grads)[k], rtol=1e-5, atol=1e-12)
    loose = optim.clip_by_global_norm(float(norm) * 2)
    same, _ = loose.update(grads, loose.init(params))
    assert (same == grads).all()  # below the threshold: bitwise unchanged
    with pytest.raises(ValueError, match="max_norm.*> 0"):
        optim.clip_by_global_norm(0.0)
