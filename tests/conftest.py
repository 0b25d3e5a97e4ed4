"""Suite-wide test settings and shared fixtures.

The tiny models, loss and batches the tests build with arguments are factories in ``_tiny.py``;
the one multi-process run of the suite is ``_two_ranks.py``, run once per session here.
"""

import json
import random

import numpy as np
import pytest
import torch

from ftrain import data
from ftrain.distributed import run_distributed
from ftrain.internals import dynamo

from _tiers import slow_reason


def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` every test that starts processes or subprocesses, runs a notebook or
    compiles, measures a step's peak memory or trains through the ftrain command, read off its
    source and its fixtures' (``_tiers.py`` says how and why), so that
    ``python -m pytest -q -m "not slow"`` is the fast tier. The full suite runs them all."""
    for item in items:
        fn = getattr(item, "function", None)
        if fn is None or item.get_closest_marker("slow"):
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        reason = slow_reason(fn, [d[-1].func for d in defs if d], item.fixturenames)
        if reason:
            item.add_marker(pytest.mark.slow(reason=reason))


@pytest.fixture
def whole_step_graphs():
    """Skips a test that checks a compiled step is one graph, on a torch whose dynamo cannot
    trace the step's gradient in one (torch 2.11 breaks it at ``requires_grad_``). Found by a
    probe (``ftrain.internals.dynamo.traces_whole_steps``), not by the version number."""
    if not dynamo.traces_whole_steps():
        pytest.skip(
            f"torch {torch.__version__}: dynamo breaks the graph at requires_grad_, so a "
            "compiled step is several graphs (torch 2.13 traces it as one)"
        )


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Run the suite's tiny models on one torch thread: they gain nothing from intra-op threads,
    and on a busy 2-core machine two threads waiting for each other cost many times the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- token builds (tests/data/test_build.py, tests/data/test_datasets.py) -------------------------


@pytest.fixture(scope="session")
def token_corpus(tmp_path_factory):
    """40 UTF-8 files of varied length, plus one undecodable, one empty and one missing file
    among them: ``(paths, texts of the 40 good files in order)``."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["def", "return", "x", "élan", "€", "self", "\n", "    ", "import", "🙂", "=", "(", ")"]
    paths, texts = [], []
    for i in range(40):
        text = " ".join(rng.choice(words) for _ in range(rng.choice([3, 20, 80, 300])))
        p = root / f"doc{i:02d}.py"
        p.write_text(text, encoding="utf-8")
        paths.append(p)
        texts.append(text)
    (root / "latin1.py").write_bytes("café = 1\n".encode("latin-1"))
    (root / "empty.py").write_text("")
    bad = [root / "latin1.py", root / "empty.py", root / "missing.py"]
    return paths[:20] + bad + paths[20:], texts


@pytest.fixture(scope="session")
def token_build(token_corpus, tmp_path_factory):
    """``token_corpus`` built with the default ByteTokenizer."""
    out = tmp_path_factory.mktemp("built")
    data.build_token_dataset(token_corpus[0], out, progress=False)
    return out


@pytest.fixture(scope="session")
def read_docs():
    """Reference reader: ``read_docs(path)`` is the list of documents of a build (token arrays,
    each ending with eot), read from its files by hand."""

    def read(path):
        meta = json.loads((path / "meta.json").read_text())
        tokens = np.fromfile(path / "tokens.bin", dtype=meta["dtype"])
        offsets = np.load(path / "docs.npy")
        return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]

    return read


# --- the ftrain command (tests/app/test_cli.py, tests/app/test_loop.py) -------------------------------


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


# --- the 2-rank run (tests/transforms/test_shard.py, tests/distributed/test_*.py) ---------------


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> list[dict]:
    """What :func:`_two_ranks.on_two_ranks` returned on each of 2 gloo processes, in rank order.
    The suite's one ``run_distributed`` of the shard checks (about 20 s): every test that needs
    ranks reads its results, none starts processes of its own."""
    from _two_ranks import WORLD, on_two_ranks

    return run_distributed(on_two_ranks, WORLD, str(tmp_path_factory.mktemp("two_ranks")))


# --- the pipeline runs (tests/transforms/test_pipeline.py) ----------------------------------------


@pytest.fixture(scope="session")
def pipeline_two_ranks(tmp_path_factory) -> list[dict]:
    """What :func:`_pipeline_ranks.on_two_ranks` returned on each of 2 gloo processes (pp = 2):
    every schedule, the compositions, a checkpoint resumed on another schedule, the errors."""
    from _pipeline_ranks import on_two_ranks

    return run_distributed(on_two_ranks, 2, str(tmp_path_factory.mktemp("pipeline")))


@pytest.fixture(scope="session")
def pipeline_four_ranks(tmp_path_factory) -> list[dict]:
    """What :func:`_pipeline_ranks.on_four_ranks` returned on each of 4 gloo processes: pp = 4,
    dp 2 x pp 2 under ft.shard and pp 2 x tp 2, each saving a checkpoint of its stages' pieces,
    and one of them loaded onto other layouts."""
    from _pipeline_ranks import on_four_ranks

    return run_distributed(on_four_ranks, 4, str(tmp_path_factory.mktemp("pipeline4")), timeout=400)


@pytest.fixture(scope="session")
def pipeline_eight_ranks() -> list[dict]:
    """What :func:`_pipeline_ranks.on_eight_ranks` returned on each of 8 gloo processes: the
    3-D mesh, dp 2 x pp 2 x tp 2 (about a minute on 2 cores)."""
    from _pipeline_ranks import on_eight_ranks

    return run_distributed(on_eight_ranks, 8, timeout=600)


# --- the memory planner's 2-rank run (tests/memory/test_predict.py, tests/memory/test_fake_fsdp.py) ------


@pytest.fixture(scope="session")
def memory_ranks() -> list[dict]:
    """What :func:`_memory_ranks.on_two_ranks` returned on each of 2 gloo processes, in rank
    order: ``ft.memory``'s predicted and the measured peaks under ddp, zero1, zero2 and fsdp."""
    from _memory_ranks import on_two_ranks

    return run_distributed(on_two_ranks, 2, timeout=240)


# --- sharded checkpoints (tests/io/test_sharded.py, tests/io/test_reshard.py, tests/io/test_consolidate.py)


@pytest.fixture(scope="session")
def sharded_checkpoints(tmp_path_factory) -> tuple[str, dict]:
    """``(root, found)``: the checkpoints that :mod:`_sharded_ranks` saves on 2 and then 3 gloo
    processes (about 35 s; the second launch ends with rank 1 killed mid-save, on purpose), and
    what each rank found, by ``"two0"``, ``"two1"``, ``"three0"``, ... ."""
    import os

    from ftrain.distributed import DistributedError

    from _sharded_ranks import on_three, on_two

    root = str(tmp_path_factory.mktemp("sharded"))
    run_distributed(on_two, 2, root)
    with pytest.raises(DistributedError, match="rank 1 ---\nthe process exited with code 9"):
        run_distributed(on_three, 3, root, timeout=240)
    found = {}
    for name, world in (("two", 2), ("three", 3)):
        for r in range(world):
            with open(os.path.join(root, f"{name}-rank{r}.json")) as f:
                found[f"{name}{r}"] = json.load(f)
    return root, found
