"""Suite-wide test settings."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Run the suite's tiny models on one torch thread: they gain nothing from intra-op threads,
    and on a busy 2-core machine two threads waiting for each other cost many times the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
