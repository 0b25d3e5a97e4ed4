"""ftrain.distributed.launch: run_distributed starts ranks that find their group (and reports a
failing rank with its traceback), init() and the mesh helpers refuse what they cannot use, naming
how to launch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ftrain.distributed import (
    DistributedError,
    check_mesh,
    default_mesh,
    init,
    is_initialized,
    rank_and_world,
    require_group,
    run_distributed,
)
from ftrain.distributed.launch import backend_for, group_device, reduces_host_tensors, runs_nccl


def test_ranks_see_their_rank_and_world_and_init_finds_the_group(two_ranks):
    """run_distributed creates each rank's group before calling fn, as torchrun + init would:
    init() then returns at once with the same (rank, world)."""
    assert [r["rank"] for r in two_ranks] == [0, 1]
    assert [r["rank_and_world"] for r in two_ranks] == [(0, 2), (1, 2)]
    assert [r["init"] for r in two_ranks] == [(0, 2), (1, 2)]


def _fails_on_rank_1():
    if dist.get_rank() == 1:
        raise KeyError("only on rank 1")
    dist.barrier()  # rank 0 waits for a rank that never comes: it is stopped
    return "unreachable"


def test_run_distributed_reports_the_failing_rank_with_its_traceback():
    with pytest.raises(DistributedError, match=r"(?s)rank 1 ---\nKeyError.*only on rank 1"):
        run_distributed(_fails_on_rank_1, 2, timeout=120)


def _what_a_rank_sees():
    import os
    import sys

    return os.environ.get("FTRAIN_TEST_MARK"), os.getcwd(), sys.path[0], os.environ["RANK"]


def test_each_call_s_ranks_see_its_environment_directory_and_path(tmp_path, monkeypatch):
    """The ranks are forked from a server started at the first call, yet each call's ranks see
    the caller's environment, working directory and import path as of that call, as spawned
    processes would: here two calls in a row, the second after all three changed."""
    for i in range(2):
        monkeypatch.setenv("FTRAIN_TEST_MARK", f"call {i}")
        where = tmp_path / f"call{i}"
        where.mkdir()
        monkeypatch.chdir(where)
        monkeypatch.syspath_prepend(str(where / "modules"))
        got = run_distributed(_what_a_rank_sees, 2, timeout=120)
        want = (f"call {i}", str(where), str(where / "modules"))
        assert got == [(*want, "0"), (*want, "1")]


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_run_distributed_refuses_a_bad_world_size(world_size):
    with pytest.raises(ValueError, match=r"world_size=.*must be an int >= 1"):
        run_distributed(print, world_size)


def test_run_distributed_refuses_what_it_cannot_call():
    with pytest.raises(TypeError, match=r"fn must be callable, got str"):
        run_distributed("train", 2)


def test_without_a_group_there_is_one_process_of_rank_0():
    assert not is_initialized()
    assert rank_and_world() == (0, 1)


def test_init_without_torchruns_variables_says_how_to_launch(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(
        RuntimeError,
        match=r"WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set.*torchrun --nproc_per_node 2"
        r".*run_distributed",
    ):
        init()
    assert not is_initialized()


def test_mesh_helpers_without_a_group_name_the_caller_and_the_launch():
    with pytest.raises(
        RuntimeError, match=r"ft\.my_fn: no torch\.distributed process group.*torchrun"
    ):
        require_group("my_fn")
    with pytest.raises(RuntimeError, match=r"ft\.default_mesh: no torch\.distributed"):
        default_mesh()
    with pytest.raises(RuntimeError, match=r"ft\.default_mesh: no torch\.distributed"):
        check_mesh(None, "shard")  # None means the default mesh


def test_check_mesh_refuses_what_is_not_a_1d_device_mesh():
    with pytest.raises(ValueError, match=r"ft\.shard\(mesh=\.\.\.\): expected a 1-D .*DeviceMesh"):
        check_mesh("cpu", "shard")


@pytest.mark.parametrize(
    "backend,nccl",
    [("nccl", True), ("gloo", False), ("cpu:gloo,cuda:nccl", True), ("cpu:gloo", False),
     ("cuda:nccl", True), ("mpi", False)],
)  # fmt: skip
def test_a_group_runs_nccl_alone_or_for_cuda_tensors_beside_gloo(backend, nccl):
    assert runs_nccl(backend) is nccl


@pytest.mark.parametrize(
    "backend,host",
    [("nccl", False), ("gloo", True), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl", False),
     ("cpu:gloo", True), ("mpi", True)],
)  # fmt: skip
def test_a_group_reduces_host_tensors_with_gloo_or_a_cpu_part(backend, host):
    assert reduces_host_tensors(backend) is host


def test_the_backend_for_a_device_adds_gloo_beside_nccl_only_for_host_collectives():
    assert backend_for("cpu") == backend_for("cpu", host_collectives=True) == "gloo"
    assert backend_for("cuda:1") == "nccl"  # a name: no GPU needed to ask
    backend = backend_for(torch.device("cuda"), host_collectives=True)
    assert runs_nccl(backend) and reduces_host_tensors(backend)


def test_the_group_device_is_the_cpu_under_gloo_and_the_gpu_wherever_nccl_runs(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert group_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # no GPU needed to ask
    assert group_device() == torch.device("cuda", 3)
