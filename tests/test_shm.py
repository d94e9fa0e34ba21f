"""The same-host shared-memory path: values, copy semantics, buffer reuse, cleanup.

The test process itself is worker0 here (the Python API), with real worker processes.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed.rpc as rpc
from conftest import children_of, kill_all, pid_alive, worker_pids

import rpcnb
from rpcnb import shm

MB = 1 << 20
# The workers cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def echo(t):
    return t


def ns():
    """The worker's remote-cell namespace (functions shipped by value get fresh globals)."""
    from rpcnb import state

    return state.current().runner.namespace


def keep(t):
    ns()["kept"] = t
    return t.sum().item()


def kept_sum():
    return ns()["kept"].sum().item()


def bump_kept():
    ns()["kept"].add_(100)
    return ns()["kept"].sum().item()


def drop_kept():
    del ns()["kept"]
    return True


def stats():
    from rpcnb import shm as s

    return s.stats()


@pytest.fixture
def api_group():
    seen: set[int] = set()
    rpcnb.init(2)
    try:
        yield seen
    finally:
        seen.update(children_of(os.getpid()))
        try:
            rpcnb.shutdown()
        finally:
            kill_all(sorted(p for p in seen if pid_alive(p)))


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_large_tensors_arrive_equal_through_shared_memory(api_group):
    before = shm.stats()
    t = torch.randn(4 * MB // 4)
    back = rpc.rpc_sync("worker1", echo, args=(t,))
    assert torch.equal(back, t)
    after = shm.stats()
    assert after["sent"] == before["sent"] + 1
    assert after["received"] == before["received"] + 1
    assert rpc.rpc_sync("worker1", stats)["received"] >= 1
    # non-contiguous, other dtypes
    for x in (torch.arange(2 * MB, dtype=torch.int64).view(1024, -1).t(),
              torch.rand(MB) > 0.5, torch.randn(MB // 2, dtype=torch.float64)):
        assert torch.equal(rpc.rpc_sync("worker2", echo, args=(x,)), x)


def test_copy_semantics_hold_under_buffer_reuse(api_group):
    t = torch.ones(MB)  # 4 MB
    total = float(t.numel())
    assert rpc.rpc_sync("worker1", keep, args=(t,)) == total
    t.add_(1)  # the sender changes its tensor: the receiver's copy must not
    assert rpc.rpc_sync("worker1", kept_sum) == total
    # while worker1 holds the first buffer, a second send must not reuse it
    t2 = torch.full((MB,), 7.0)
    rpc.rpc_sync("worker2", keep, args=(t2,))
    assert rpc.rpc_sync("worker1", kept_sum) == total
    assert shm.stats()["in_flight"] == 2
    # and the receiver's writes never reach the sender
    rpc.rpc_sync("worker1", bump_kept)
    assert torch.equal(t, torch.full((MB,), 2.0))
    # freeing the receiving tensor hands the buffer back; the next send reuses it
    rpc.rpc_sync("worker1", drop_kept)
    rpc.rpc_sync("worker2", drop_kept)
    assert wait_for(lambda: shm.stats()["in_flight"] == 0)
    buffers = shm.stats()["buffers"]
    rpc.rpc_sync("worker1", keep, args=(torch.zeros(MB),))
    assert shm.stats()["buffers"] == buffers
    assert rpc.rpc_sync("worker1", kept_sum) == 0.0


def test_views_keep_the_buffer_until_the_last_one_is_freed(api_group):
    back = rpc.rpc_sync("worker1", echo, args=(torch.randn(MB),))
    view = back[10:20]
    worker_stats = rpc.rpc_sync("worker1", stats)
    assert worker_stats["in_flight"] == 1  # worker1's result buffer, held by us
    del back
    time.sleep(0.2)
    assert rpc.rpc_sync("worker1", stats)["in_flight"] == 1
    del view
    assert wait_for(lambda: rpc.rpc_sync("worker1", stats)["in_flight"] == 0)


def test_small_grad_and_disabled_keep_tensorpipe(api_group):
    before = shm.stats()["sent"]
    small = torch.randn(100)
    assert torch.equal(rpc.rpc_sync("worker1", echo, args=(small,)), small)
    grad = torch.randn(MB, requires_grad=True)
    assert torch.equal(rpc.rpc_sync("worker1", echo, args=(grad.detach().requires_grad_(),)),
                       grad.detach())
    shm.set_enabled(False)
    try:
        big = torch.randn(MB)
        assert torch.equal(rpc.rpc_sync("worker1", echo, args=(big,)), big)
    finally:
        shm.set_enabled(True)
    assert shm.stats()["sent"] == before


def test_path_is_off_outside_a_single_host_group():
    # Not in a group (or in one whose members are on several hosts): never taken.
    assert not shm.is_active()
    assert not shm.wants(torch.randn(4 * MB))


@pytest.mark.gpu
def test_cuda_tensors_keep_tensorpipe():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine: the CUDA fallback cannot be exercised")
    shm.activate("gpu-check")
    try:
        assert not shm.wants(torch.randn(4 * MB, device="cuda"))
    finally:
        shm.deactivate()


def test_remote_cells_push_and_fetch_use_shared_memory(api_group):
    before = shm.stats()
    big = torch.arange(MB, dtype=torch.float32)
    out = rpcnb.run("worker1", "big * 2", push={"big": big}, fetch=True)
    assert torch.equal(out, big * 2)
    after = shm.stats()
    assert after["sent"] == before["sent"] + 1  # the push
    assert after["received"] == before["received"] + 1  # the fetched result
    r = rpcnb.run("worker2", "import torch\ntorch.ones(2 * 1024 * 1024)")
    assert r.to_here().sum().item() == 2 * MB
    assert shm.stats()["received"] == after["received"] + 1


def test_no_buffers_left_after_shutdown_and_worker_kill():
    seen: set[int] = set()
    rpcnb.init(2)
    try:
        from rpcnb import state

        group = state.current().group_id
        keep_remote = rpcnb.run("worker1", "import torch\nbig = torch.ones(MB := 2**20)\nbig")
        fetched = keep_remote.to_here()  # worker1's buffer, held here
        rpc.rpc_sync("worker2", keep, args=(torch.ones(MB),))  # our buffer, held there
        assert len(shm.leftovers(group)) >= 2
        pid1 = state.current().procs["worker1"].pid
        assert any(f"-{pid1}-" in p for p in shm.leftovers(group))
        os.kill(pid1, signal.SIGKILL)
        assert wait_for(lambda: not any(f"-{pid1}-" in p for p in shm.leftovers(group)))
        assert fetched.sum().item() == MB  # still readable: unlinking keeps mappings
        seen.update(children_of(os.getpid()))
        rpcnb.shutdown()
        assert shm.leftovers(group) == []
    finally:
        seen.update(children_of(os.getpid()))
        if state.is_initialized():
            rpcnb.shutdown()
        kill_all(sorted(p for p in seen if pid_alive(p)))


def test_no_buffers_left_after_the_kernel_dies(group):
    group.execute("import torch, torch.distributed.rpc as rpc\n"
                  "def keep(t):\n    global kept\n    kept = t\n"
                  "rpc.rpc_sync('worker1', keep, args=(torch.ones(2**20),))")
    gid = group.value("__import__('rpcnb.state').state.current().group_id")
    group.execute("%%remote worker2 -o r\nimport torch\ntorch.ones(2**20)")
    group.execute("x = r.to_here()")
    pids = worker_pids(group)
    assert any(f"-{group.pid}-" in p for p in shm.leftovers(gid))
    os.kill(group.pid, signal.SIGKILL)
    assert wait_for(lambda: not any(pid_alive(pids[n]) for n in ("worker1", "worker2")), 15)
    assert shm.leftovers(gid) == []
