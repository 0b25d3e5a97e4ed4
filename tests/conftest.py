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


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> list[str]:
    """`ftrain train` flags for a tiny, fast run: a GPT of width 32 with 2 blocks on 32-byte rows,
    4 rows a batch, a metrics line every step, no evaluation, sample or progress bar. The token
    cache they name is built by the first run and shared by the session."""
    tokens = str(tmp_path_factory.mktemp("tokens"))
    return [
        "--d-model", "32", "--n-layer", "2", "--n-head", "2", "--seq-len", "32",
        "--batch-size", "4", "--eval-every", "0", "--sample-tokens", "0", "--no-progress",
        "--log-every", "1", "--data-dir", tokens,
    ]  # fmt: skip
