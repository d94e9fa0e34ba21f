"""The same-host shared-memory path: values, copy semantics, buffer reuse, cleanup.

The test process itself is worker0 here (the Python API), with real worker processes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import cloudpickle
import pytest
import torch
import torch.distributed.rpc as rpc
from conftest import Seen, pid_alive, run_watched, started_here, wait_until, worker_pids

import rpcnb
from rpcnb.paths import shm

MB = 1 << 20
# The workers cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def echo(t):
    return t


def ns():
    """The worker's remote-cell namespace (functions shipped by value get fresh globals)."""
    from rpcnb.session import state

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


def fresh(n):
    import torch

    return torch.randn(n)


def stats():
    from rpcnb.paths import shm as s

    return s.stats()


API_WORKERS = 2  # conftest.api_group: this process, worker1 and worker2


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
    assert wait_until(lambda: shm.stats()["in_flight"] == 0)
    buffers = shm.stats()["buffers"]
    rpc.rpc_sync("worker1", keep, args=(torch.zeros(MB),))
    assert shm.stats()["buffers"] == buffers
    assert rpc.rpc_sync("worker1", kept_sum) == 0.0


def test_views_keep_the_buffer_until_the_last_one_is_freed(api_group):
    # a tensor worker1 makes (an echo of ours would come back by handle: rpcnb.paths.zerocopy)
    back = rpc.rpc_sync("worker1", fresh, args=(MB,))
    control = rpc.rpc_sync("worker1", fresh, args=(MB,))  # the same, with no view
    view = back[10:20]
    assert rpc.rpc_sync("worker1", stats)["in_flight"] == 2  # worker1's result buffers, ours
    del back
    del control
    # the control's buffer goes back (freed after `back`): had `back`'s been freed, it
    # would be back by now too; it is not, because of the view
    assert wait_until(lambda: rpc.rpc_sync("worker1", stats)["in_flight"] == 1)
    assert rpc.rpc_sync("worker1", stats)["in_flight"] == 1
    del view
    assert wait_until(lambda: rpc.rpc_sync("worker1", stats)["in_flight"] == 0)


def send_on_with_a_lock():
    """On a worker: send its kept tensor on to worker2, with a lock beside it."""
    import threading

    import torch.distributed.rpc as rpc

    try:
        rpc.rpc_sync("worker2", echo, args=(ns()["kept"], threading.Lock()))
    except TypeError as exc:
        return f"failed: {exc}"
    return "sent"


def test_a_call_that_cannot_be_pickled_gives_its_buffers_back(api_group):
    import threading

    t = torch.randn(4 * MB // 4)
    before = shm.stats()
    for _ in range(3):  # a lock beside the tensor: pickling fails after the tensor took a buffer
        with pytest.raises(TypeError, match="pickle"):
            rpc.rpc_sync("worker1", echo, args=(t, threading.Lock()))
    after = shm.stats()
    assert after["in_flight"] == before["in_flight"], "a message never sent holds no buffer"
    assert after["sent"] == before["sent"], "nothing counted as sent"
    assert after["buffers"] <= before["buffers"] + 1, "each failed call took a buffer of its own"
    # the next call reuses that buffer, and its tensor arrives whole
    assert torch.equal(rpc.rpc_sync("worker1", echo, args=(t,)), t)
    assert shm.stats()["buffers"] == after["buffers"]
    # a --push that cannot be sent says which value, and leaves no buffer taken either
    # (worker1 lets go of the call above's buffer once it has freed the call's arguments)
    with pytest.raises(ValueError, match="'lock'"):
        rpcnb.run("worker1", "x", push={"x": t, "lock": threading.Lock()})
    assert wait_until(lambda: shm.stats()["in_flight"] == 0)


def test_a_send_that_failed_lets_its_tensors_go_with_its_error(api_group):
    """No reference cycle holds the error of a call or push that could not be pickled: the
    tensors of the message go when the caller drops the error, not at the next run of the
    cycle collector (which may be long in coming)."""
    import gc
    import threading
    import weakref

    gc.disable()
    try:
        for send in (lambda t: rpc.rpc_sync("worker1", echo, args=(t, threading.Lock())),
                     lambda t: rpcnb.run("worker1", "x", push={"x": t, "lock": threading.Lock()})):
            t = torch.randn(4 * MB // 4)
            gone = weakref.ref(t)
            try:
                send(t)
            except (TypeError, ValueError) as exc:
                assert "pickle" in str(exc) or "lock" in str(exc)
            else:
                raise AssertionError("a lock was sent")
            del t
            assert gone() is None, "the failed send's error held its tensor in a cycle"
    finally:
        gc.enable()


def test_a_buffer_sent_on_that_cannot_be_pickled_is_not_left_in_transit(api_group):
    t = torch.ones(MB)  # 4 MB into this process's buffer; worker1 keeps a tensor over it
    assert rpc.rpc_sync("worker1", keep, args=(t,)) == float(MB)
    assert shm.stats()["in_flight"] == 1
    # worker1 sends it on by handle (it marks the buffer in transit), but the call fails to
    # pickle: nothing reached worker2, so nothing may keep the buffer from this process
    said = rpc.rpc_sync("worker1", send_on_with_a_lock)
    assert said.startswith("failed") and "pickle" in said
    rpc.rpc_sync("worker1", drop_kept)
    assert wait_until(lambda: shm.stats()["in_flight"] == 0), "the buffer stays marked in transit"


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


def test_path_is_off_outside_a_single_host_group(no_api_group):
    # Not in a group (or in one whose members are on several hosts): never taken.
    assert not shm.is_active()
    assert not shm.wants(torch.randn(4 * MB))


@pytest.mark.gpu
def test_cuda_tensors_keep_tensorpipe():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine: the CUDA fallback cannot be exercised")
    pool = shm.Pool("gpu-check")  # a single-host group's, opened for sending
    pool.activate()
    try:
        assert not pool.wants(torch.randn(4 * MB, device="cuda"))
    finally:
        pool.close()


def test_no_buffers_left_after_shutdown_and_worker_kill(no_api_group):
    seen = Seen()
    rpcnb.init(2)
    try:
        from rpcnb.session import state

        group = state.current().group_id
        keep_remote = rpcnb.run("worker1", "import torch\nbig = torch.ones(MB := 2**20)\nbig")
        fetched = keep_remote.to_here()  # worker1's buffer, held here
        rpc.rpc_sync("worker2", keep, args=(torch.ones(MB),))  # our buffer, held there
        assert len(shm.leftovers(group)) >= 2
        pid1 = state.current().procs["worker1"].pid
        assert any(f"-{pid1}-" in p for p in shm.leftovers(group))
        os.kill(pid1, signal.SIGKILL)
        assert wait_until(lambda: not any(f"-{pid1}-" in p for p in shm.leftovers(group)))
        assert fetched.sum().item() == MB  # still readable: unlinking keeps mappings
        seen.update(started_here())
        rpcnb.shutdown()
        assert shm.leftovers(group) == []
    finally:
        seen.update(started_here())
        if state.is_initialized():
            rpcnb.shutdown()
        seen.kill()


def test_no_buffers_left_after_the_kernel_dies(own_kernel_group):
    own_kernel_group.execute("import torch, torch.distributed.rpc as rpc\n"
                      "def keep(t):\n    global kept\n    kept = t\n"
                      "rpc.rpc_sync('worker1', keep, args=(torch.ones(2**20),))")
    gid = own_kernel_group.value("__import__('rpcnb.session.state').session.state.current().group_id")
    own_kernel_group.execute("%%remote worker2 -o r\nimport torch\ntorch.ones(2**20)")
    own_kernel_group.execute("x = r.to_here()")
    pids = worker_pids(own_kernel_group)
    assert any(f"-{own_kernel_group.pid}-" in p for p in shm.leftovers(gid))
    os.kill(own_kernel_group.pid, signal.SIGKILL)
    assert wait_until(lambda: not any(pid_alive(pids[n]) for n in ("worker1", "worker2")), 15)
    assert shm.leftovers(gid) == []


SMALL_SHM = """
import rpcnb, torch
rpcnb.init(2)
MB = 1 << 20
for mb in (16, 48, 100):
    t = torch.full((mb * MB // 4,), float(mb))
    got = rpcnb.run("worker1", "t.sum().item()", push={"t": t}, fetch=True)  # --push
    assert got == float(mb) * t.numel(), (mb, got)
    back = rpcnb.run("worker2", f"import torch\\ntorch.full(({mb * MB // 4},), {mb}.0)",
                     fetch=True)  # --fetch
    assert torch.equal(back, t)
    r = rpcnb.run("worker1", f"import torch\\ntorch.full(({mb * MB // 4},), {mb}.0)")
    assert torch.equal(r.to_here(), t)  # to_here() of rpcnb's result
    print("ok", mb, flush=True)
rpcnb.shutdown()
print("done", flush=True)
"""


def test_a_small_dev_shm_falls_back_with_one_warning(tmp_path):
    # Docker's default /dev/shm is 64 MB: buffers whose pages cannot be reserved are never
    # made (no SIGBUS on a page tmpfs cannot back); the tensors go over TensorPipe, and the
    # group says so once
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("mount"):
        pytest.skip("a private 64 MB /dev/shm needs root, unshare and mount (a mount namespace)")
    script = tmp_path / "small_shm.py"
    script.write_text(SMALL_SHM)
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
           f"mount -t tmpfs -o size=64M tmpfs /dev/shm && exec {sys.executable} {script}"]
    returncode, output, _, seen = run_watched(
        cmd, timeout=180, poll=0.2, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR"))
    assert returncode == 0, output[-4000:]
    assert [ln for ln in output.splitlines() if ln.startswith("ok")] == ["ok 16", "ok 48", "ok 100"]
    warnings = [ln for ln in output.splitlines() if "goes over TensorPipe instead" in ln]
    assert len(warnings) == 1, output[-4000:]
    assert "--shm-size" in warnings[0]
    assert output.rstrip().endswith("done")


def test_idle_buffers_are_given_back(no_api_group, monkeypatch):
    # RPCNB_SHM_IDLE_S: a buffer nobody used for that long is unlinked by its owner and
    # unmapped by the members that mapped it, so an idle group holds no /dev/shm
    monkeypatch.setenv("RPCNB_SHM_IDLE_S", "1")  # every member reads it as it starts
    seen = Seen()
    rpcnb.init(1)
    try:
        seen.update(started_here())
        from rpcnb.session import state

        group = state.current().group_id
        assert rpc.rpc_sync("worker1", keep, args=(torch.ones(4 * MB),)) == 4 * MB
        assert shm.stats()["pool_bytes"] >= 4 * MB and shm.leftovers(group)
        rpc.rpc_sync("worker1", drop_kept)  # the worker lets go of the tensor
        assert wait_until(lambda: shm.stats()["pool_bytes"] == 0, timeout=10)
        assert wait_until(lambda: rpc.rpc_sync("worker1", stats)["mapped_bytes"] == 0, timeout=10)
        assert shm.leftovers(group) == []
        # and the path still works afterwards
        assert rpc.rpc_sync("worker1", keep, args=(torch.ones(4 * MB),)) == 4 * MB
    finally:
        seen.update(started_here())
        rpcnb.shutdown()
        seen.kill()
