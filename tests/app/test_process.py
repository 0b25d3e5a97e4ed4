"""Settings the training process applies to itself (ftrain.app.process)."""

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
)
def test_keep_freed_memory_stops_page_faults_in_the_training_loop():
    """Page faults per step of a small GPT step after keep_freed_memory() (what `ftrain train`
    calls), in a fresh process: the heap keeps the step's activations, so after the first steps
    they are not faulted in again (a few dozen faults a step at most). With glibc's defaults the
    same loop usually takes hundreds a step (667 measured here), but how many depends on glibc's
    adaptive thresholds (sometimes none), so that side is not asserted."""
    script = """
import resource, torch
import ftrain as ft
from ftrain.models import GPT, GPTConfig
from ftrain.app.process import keep_freed_memory
assert keep_freed_memory()
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=257, seq_len=128, d_model=64, n_layer=2, n_head=2, bias=False))
opt = ft.optim.adamw(1e-3)
state = ft.TrainState.create(ft.params_of(model), opt)
loss = lambda p, b: ft.losses.cross_entropy(ft.apply(model, p, b[:, :-1]), b[:, 1:])
step = ft.train_step(loss, opt, donate=True)
batch = torch.randint(0, 257, (8, 129))
for _ in range(3):
    state, _ = step(state, batch)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    state, _ = step(state, batch)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 10)
"""
    per_step = int(subprocess.check_output([sys.executable, "-c", script], text=True))
    assert per_step < 100
