"""ftrain.data's torchdata side (ftrain/data/nodes.py): the loader's worker threads leave the
caller's thread count, and closing an iterator stops them."""

import itertools
import subprocess
import sys
import threading

import pytest
import torch

from ftrain import data

from _data import Numbered


def test_thread_workers_leave_the_callers_thread_count():
    # torchdata's workers call torch.set_num_threads(1); in a fresh process that count is the
    # process's, so training would run on one thread. Fresh process: the default count is unset.
    code = (
        "import torch\n"
        "from ftrain import data\n"
        "torch.set_num_threads(2)\n"
        "ds = [{'x': torch.tensor([i])} for i in range(64)]\n"
        "it = iter(data.loader(ds, 4, num_workers=2, infinite=True))\n"
        "for _ in range(5):\n"
        "    next(it)\n"
        "print(torch.get_num_threads())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split()[-1] == "2"


@pytest.mark.parametrize("prefetch", [0, 2])
def test_close_stops_the_worker_threads(prefetch):
    before = set(threading.enumerate())
    ld = data.loader(Numbered(64), 4, num_workers=2, prefetch=prefetch, infinite=True)
    with iter(ld) as it:
        first = next(it)["id"]
        assert len(set(threading.enumerate()) - before) >= 2  # the workers run
    assert set(threading.enumerate()) - before == set()
    with pytest.raises(StopIteration):
        next(it)
    again = next(iter(ld))["id"]  # the position is kept: the next batch, not the first again
    assert not torch.equal(again, first)
    ref = list(itertools.islice(iter(data.loader(Numbered(64), 4, infinite=True)), 2))
    assert torch.equal(ref[0]["id"], first) and torch.equal(ref[1]["id"], again)
