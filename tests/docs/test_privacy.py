"""docs/privacy.md: its code runs as one script and does what the text says: per-example gradients
of the right shape whose mean is the batch gradient, and a DP-SGD run that learns, with the
metrics the text lists and the noise standard deviation of its formula."""

import re
import warnings
from pathlib import Path

import torch

import ftrain as ft

DOC = Path(__file__).resolve().parents[2] / "docs" / "privacy.md"


def test_privacy_guide_runs_and_keeps_its_promises():
    code = "\n".join(re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S))
    env: dict = {"__name__": "privacy.md"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on unbatched attention kernels, if any
        exec(compile(code, str(DOC), "exec"), env)
    grads, params, loss_fn = env["grads"], env["params"], env["loss_fn"]
    x, y = env["x"], env["y"]
    assert grads["0", "weight"].shape == (16, 32, 10)
    # a plain mean loss over equal rows: the mean of the rows is the batch's gradient
    p = params.apply(lambda t: t.detach().requires_grad_(True))
    whole = torch.autograd.grad(loss_fn(p, (x, y)).value, ft.tree.leaves(p))
    for row, g in zip(ft.tree.leaves(grads), whole):
        torch.testing.assert_close(row.mean(0), g, atol=1e-6, rtol=0)
    assert env["norms"].shape == (16,)
    metrics, losses = env["metrics"], env["losses"]
    assert set(metrics) == {"loss", "count", "grad_norm", "lr", "clipped", "noise_std"}
    assert int(metrics["count"]) == 64
    torch.testing.assert_close(metrics["noise_std"], torch.tensor(1.1 * 1.0 / 64))
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
