"""Zero-copy for tensors already in shared memory (rpcnb.paths.zerocopy): values, sharing
semantics both ways, both torch.multiprocessing strategies, the opt-outs (per call, per
block, per group) that copy instead, the path in telemetry and %rpc_channels, and nothing
left in /dev/shm afterwards.

The test process itself is worker0 here (the Python API), with real worker processes;
one test drives a real kernel through its magics.
"""

from __future__ import annotations

import glob
import os
import sys

import cloudpickle
import torch
import torch.distributed.rpc as rpc
from conftest import Seen, started_here, wait_until
from test_shm import bump_kept, keep, kept_sum, ns  # pickled by value, as this module's

import rpcnb
from rpcnb import telemetry
from rpcnb.observe import channels
from rpcnb.paths import shm, zerocopy

MB = 1 << 20
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def forward_kept(to):
    """worker1 sends the tensor it keeps on to another member."""
    import torch.distributed.rpc as rpc

    return rpc.rpc_sync(to, keep, args=(ns()["kept"],))


def forward_kept_copying(to):
    import torch.distributed.rpc as rpc

    import rpcnb

    with rpcnb.copying():
        return rpc.rpc_sync(to, keep, args=(ns()["kept"],))


def echo(t):
    return t


def drop_kept(*more):
    """Let go of the kept tensor, then of the tensors kept under the names ``more``."""
    ns().pop("kept", None)
    for name in more:
        ns().pop(name, None)
    return True


def keep_as(name, t):
    ns()[name] = t
    return True


def shared_of_own(strategy="file_descriptor"):
    """A tensor this worker made and put in shared memory (with torch.multiprocessing's
    ``strategy``), kept in its namespace. (The file-system strategy starts a
    torch_shm_manager child: in a worker, it ends with the worker.)"""
    import torch
    import torch.multiprocessing as mp

    mp.set_sharing_strategy(strategy)
    t = torch.ones(MB)
    t.share_memory_()
    ns()["own"] = t
    return t


def own_sum():
    return ns()["own"].sum().item()


def counters():
    from rpcnb.paths import shm, zerocopy

    return {"zero_copy": zerocopy.stats(), "shm": shm.stats()}


def torch_shm_files(pids):
    """/dev/shm files torch's shared memory made for these processes (file-system
    strategy: named torch_<pid>_...; the file-descriptor strategy unlinks at once)."""
    return [p for p in glob.glob("/dev/shm/torch_*")
            if any(os.path.basename(p).startswith(f"torch_{pid}_") for pid in pids)]


def _start(**kwargs):
    seen = Seen()
    rpcnb.init(2, **kwargs)
    return seen


def _stop(seen):
    seen.update(started_here())
    try:
        rpcnb.shutdown()
    finally:
        seen.kill()


API_WORKERS = 2  # conftest.api_group: this process, worker1 and worker2


def test_shared_tensor_goes_by_handle_and_both_sides_see_writes(api_group):
    t = torch.arange(MB, dtype=torch.float32)
    t.share_memory_()
    total = t.sum().item()
    before, shm_before = zerocopy.stats(), shm.stats()
    assert rpc.rpc_sync("worker1", keep, args=(t,)) == total
    assert zerocopy.stats()["sent"] == before["sent"] + 1
    assert shm.stats()["sent"] == shm_before["sent"]  # no copy into a pool buffer
    assert rpc.rpc_sync("worker1", counters)["zero_copy"]["received"] >= 1
    t.add_(1)  # the sender writes: the receiver sees it
    assert rpc.rpc_sync("worker1", kept_sum) == total + MB
    rpc.rpc_sync("worker1", bump_kept)  # the receiver writes: the sender sees it
    assert t[0].item() == 101.0
    # a view goes as a view of the same storage
    view = t[10:20]
    assert rpc.rpc_sync("worker2", keep, args=(view,)) == view.sum().item()
    view.zero_()
    assert rpc.rpc_sync("worker2", kept_sum) == 0.0
    # what arrived by handle is itself shared: worker1 forwards it to worker2 by handle
    assert rpc.rpc_sync("worker1", forward_kept, args=("worker2",)) == t.sum().item()
    t.fill_(2.0)
    assert rpc.rpc_sync("worker2", kept_sum) == 2.0 * MB
    # small shared tensors too (semantics do not depend on size)
    small = torch.zeros(4)
    small.share_memory_()
    rpc.rpc_sync("worker1", keep, args=(small,))
    rpc.rpc_sync("worker1", bump_kept)
    assert small.tolist() == [100.0] * 4
    for w in ("worker1", "worker2"):
        rpc.rpc_sync(w, drop_kept)


def test_storages_are_held_until_their_call_completes_not_longer(api_group):
    """The sender holds a storage it handed over by handle until the receiver has it: once
    the call completes (rpc_sync, rpc_async, remote), not for RPCNB_ZERO_COPY_HOLD_S more."""
    t = torch.ones(MB).share_memory_()
    held = zerocopy.stats()["held"]
    assert rpc.rpc_sync("worker1", echo, args=(t,)) is not None
    assert zerocopy.stats()["held"] == held
    fut = rpc.rpc_async("worker1", echo, args=(t,))
    fut.wait()
    assert wait_until(lambda: zerocopy.stats()["held"] == held, timeout=5)
    rref = rpc.remote("worker1", echo, args=(t,))
    rref.to_here()
    assert wait_until(lambda: zerocopy.stats()["held"] == held, timeout=5)
    assert zerocopy.stats()["sent"] >= 3


def test_a_cells_push_goes_by_handle_is_released_and_counted(api_group, monkeypatch):
    """A remote cell's request goes out without torch's Python around rpc_async
    (rpcnb.paths.calls.request): its pushed shared tensor still goes by handle, the sender
    holds it until the cell has answered, and the call is counted for the monitor; with a
    torch profiler on, the cell goes torch's way (rpc_async) and works the same."""
    from rpcnb.session import protocol

    monkeypatch.delenv("RPCNB_CALL_TIMES", raising=False)  # timed calls go torch's way
    assert rpcnb.run("worker1", "None", fetch=True) is None  # the first request finds protocol
    torch_way = []
    call_async = protocol.call_async  # torch's way for a request (the short one: send_async)
    monkeypatch.setattr(protocol, "call_async", lambda *a, **k: (
        a[2] == "run_cell" and torch_way.append(a[2])) or call_async(*a, **k))
    t = torch.ones(MB).share_memory_()
    held, sent = zerocopy.stats()["held"], zerocopy.stats()["sent"]
    calls_before, since = telemetry.summary("worker1")["calls"], telemetry.now()
    assert rpcnb.run("worker1", "p.add_(1); p.sum().item()", push={"p": t}, fetch=True) \
        == 2.0 * MB
    assert torch_way == []  # the short way
    assert t[0].item() == 2.0  # the worker wrote into this process's storage
    assert zerocopy.stats()["sent"] == sent + 1
    assert wait_until(lambda: zerocopy.stats()["held"] == held, timeout=5)
    # the monitor sees the tensor handed over and the cell, and counts the request too
    ops = [r["op"] for r in telemetry.records("worker1", since=since)]
    assert ops == ["tensor", "cell"]
    assert telemetry.summary("worker1")["calls"] == calls_before + len(ops) + 1
    with torch.autograd.profiler.profile():
        assert rpcnb.run("worker1", "p.sum().item()", push={"p": t}, fetch=True) == 2.0 * MB
    assert torch_way == ["run_cell"]
    assert wait_until(lambda: zerocopy.stats()["held"] == held, timeout=5)


def test_file_system_strategy_tensor_goes_by_handle(api_group):
    # worker1 makes it (file-system strategy) and sends it here, we send it to worker2
    t = rpc.rpc_sync("worker1", shared_of_own, args=("file_system",))
    assert t.is_shared() and t.sum().item() == MB
    t.mul_(3)
    assert rpc.rpc_sync("worker1", own_sum) == 3.0 * MB
    before = zerocopy.stats()["sent"]
    assert rpc.rpc_sync("worker2", keep, args=(t,)) == 3.0 * MB
    assert zerocopy.stats()["sent"] == before + 1
    rpc.rpc_sync("worker2", bump_kept)
    assert rpc.rpc_sync("worker1", own_sum) == 103.0 * MB
    rpc.rpc_sync("worker2", drop_kept)


def test_a_workers_shared_tensor_comes_back_by_handle(api_group):
    own = rpc.rpc_sync("worker1", shared_of_own)
    assert own.is_shared() and own.sum().item() == MB
    own.fill_(5.0)
    assert rpc.rpc_sync("worker1", own_sum) == 5.0 * MB
    # a remote cell's fetched value too, unless the call says zero_copy=False
    got = rpcnb.run("worker2", "import torch\nw = torch.zeros(MB := 2**20)\nw.share_memory_()",
                    fetch=True)
    got.fill_(1.0)
    assert rpcnb.run("worker2", "w.sum().item()", fetch=True) == MB
    copied = rpcnb.run("worker2", "w", fetch=True, zero_copy=False)
    copied.fill_(9.0)
    assert rpcnb.run("worker2", "w.sum().item()", fetch=True) == MB


def test_a_pool_buffer_is_sent_on_by_handle(api_group):
    t = torch.ones(MB)  # not shared: worker1 gets a copy in our pool buffer (rpcnb_shm)
    assert rpc.rpc_sync("worker1", keep, args=(t,)) == MB
    w1_before = rpc.rpc_sync("worker1", counters)
    # worker1 sends it on: by handle to the same buffer, not copied into its own pool
    assert rpc.rpc_sync("worker1", forward_kept, args=("worker2",)) == MB
    w1 = rpc.rpc_sync("worker1", counters)
    assert w1["zero_copy"]["sent"] == w1_before["zero_copy"]["sent"] + 1
    assert w1["shm"]["sent"] == w1_before["shm"]["sent"]
    # the two receivers share it; we, who made the copy, do not
    rpc.rpc_sync("worker2", bump_kept)
    assert rpc.rpc_sync("worker1", kept_sum) == 101.0 * MB
    assert t.sum().item() == MB
    # the buffer is ours to reuse only when both have let go. worker1 also holds a
    # control in a buffer of its own, and lets go of it right after the shared one: once
    # the control's buffer is back, worker1's letting go has been seen here
    in_flight = shm.stats()["in_flight"]
    assert in_flight == 1  # the shared buffer, held by both
    rpc.rpc_sync("worker1", keep_as, args=("control", torch.zeros(MB)))
    assert shm.stats()["in_flight"] == in_flight + 1
    rpc.rpc_sync("worker1", drop_kept, args=("control",))
    assert wait_until(lambda: shm.stats()["in_flight"] == in_flight)  # worker2 holds it
    # new sends take the free buffers (the control's): none is the one worker2 sees
    for value in (3.0, 4.0):
        assert rpc.rpc_sync("worker1", keep_as, args=(f"new{value}", torch.full((MB,), value)))
    rpc.rpc_sync("worker1", drop_kept, args=("new3.0", "new4.0"))
    t.fill_(7.0)
    assert rpc.rpc_sync("worker2", kept_sum) == 101.0 * MB  # our writes never reach it
    rpc.rpc_sync("worker2", drop_kept)
    assert wait_until(lambda: shm.stats()["in_flight"] == 0)
    # and an echo of our tensor comes back over our own buffer, by handle, which is free
    # again once the result is freed (an in-transit mark, not a hold, kept it meanwhile)
    received = zerocopy.stats()["received"]
    back = rpc.rpc_sync("worker1", echo, args=(t,))
    assert torch.equal(back, t) and shm.stats()["in_flight"] == 1
    assert zerocopy.stats()["received"] == received + 1
    del back
    assert wait_until(lambda: shm.stats()["in_flight"] == 0)
    buffers = shm.stats()["buffers"]
    for _ in range(6):  # an echo loop reuses its buffers (worker1 frees its argument a
        # moment after answering, so the next send may take a second one): no growth
        assert rpc.rpc_sync("worker1", echo, args=(t,)).sum().item() == 7.0 * MB
    assert shm.stats()["buffers"] <= buffers + 1
    # with copying(), worker1 copies it into its own pool instead
    rpc.rpc_sync("worker1", keep, args=(t,))
    rpc.rpc_sync("worker1", forward_kept_copying, args=("worker2",))
    assert rpc.rpc_sync("worker1", counters)["shm"]["sent"] == w1["shm"]["sent"] + 1
    rpc.rpc_sync("worker2", bump_kept)
    assert rpc.rpc_sync("worker1", kept_sum) == 7.0 * MB
    for w in ("worker1", "worker2"):
        rpc.rpc_sync(w, drop_kept)


def test_opt_out_per_call_and_per_block_copies(api_group):
    t = torch.ones(MB)
    t.share_memory_()
    before, shm_before = zerocopy.stats()["sent"], shm.stats()["sent"]
    with rpcnb.copying():
        assert rpc.rpc_sync("worker1", keep, args=(t,)) == MB
    assert zerocopy.stats()["sent"] == before
    assert shm.stats()["sent"] == shm_before + 1  # copied through rpcnb's pool instead
    t.add_(1)
    assert rpc.rpc_sync("worker1", kept_sum) == MB  # copy semantics: not seen
    # rpcnb.run(..., zero_copy=False): the push is copied
    rpcnb.run("worker2", "pushed = p", push={"p": t}, zero_copy=False)
    t.add_(1)
    assert rpcnb.run("worker2", "pushed.sum().item()", fetch=True) == 2.0 * MB
    assert zerocopy.stats()["sent"] == before
    # and by default the same push shares
    rpcnb.run("worker2", "pushed = p", push={"p": t})
    t.add_(1)
    assert rpcnb.run("worker2", "pushed.sum().item()", fetch=True) == 4.0 * MB
    assert zerocopy.stats()["sent"] == before + 1
    rpc.rpc_sync("worker1", drop_kept)


def test_telemetry_names_the_zero_copy_path(api_group):
    def path_counts():
        paths = telemetry.peer_stats().get("worker1", {}).get("paths", {})
        return {p: paths.get(p, {"tensors": 0, "bytes": 0}) for p in ("zero_copy", "rpcnb_shm")}

    before = path_counts()
    t = torch.ones(MB)
    t.share_memory_()
    rpc.rpc_sync("worker1", keep, args=(t,))
    rpc.rpc_sync("worker1", keep, args=(torch.ones(MB),))  # not shared: copied
    recs = [r for r in telemetry.records("worker1") if r["op"] == "tensor"]
    assert {r["channel"] for r in recs} >= {"zero_copy", "rpcnb_shm"}
    paths = path_counts()
    assert paths["zero_copy"] == {"tensors": before["zero_copy"]["tensors"] + 1,
                                  "bytes": before["zero_copy"]["bytes"] + 4 * MB}
    assert paths["rpcnb_shm"]["tensors"] >= before["rpcnb_shm"]["tensors"] + 1
    text = channels.describe_paths(telemetry.peer_stats())
    assert "zero_copy" in text and "rpcnb_shm" in text
    rpc.rpc_sync("worker1", drop_kept)


def test_opt_out_per_group_copies_both_ways(no_api_group):
    seen = _start(zero_copy=False)
    try:
        t = torch.ones(MB)
        t.share_memory_()
        before = zerocopy.stats()["sent"]
        assert rpc.rpc_sync("worker1", keep, args=(t,)) == MB
        t.add_(1)
        assert rpc.rpc_sync("worker1", kept_sum) == MB
        assert zerocopy.stats()["sent"] == before
        own = rpc.rpc_sync("worker2", shared_of_own)  # the workers copy too
        own.fill_(5.0)
        assert rpc.rpc_sync("worker2", own_sum) == MB
        assert rpc.rpc_sync("worker2", counters)["zero_copy"]["sent"] == 0
    finally:
        _stop(seen)


def test_channels_text_and_flags_in_a_kernel(rpcnb_kernel):
    rpcnb_kernel.execute("%rpc_init --workers 1")
    rpcnb_kernel.execute("import torch\nt = torch.ones(2**20)\nt.share_memory_()")
    rpcnb_kernel.execute("%%remote worker1 --push t\nt.add_(1)")
    assert rpcnb_kernel.value("t[0].item()") == 2.0  # shared: the worker's write is here
    rpcnb_kernel.execute("%%remote worker1 --push t --copy\nt.add_(1)")
    assert rpcnb_kernel.value("t[0].item()") == 2.0  # --copy: the worker wrote to its copy
    out = rpcnb_kernel.execute("%rpc_channels --text")
    assert "zero_copy" in out.stdout and "rpcnb_shm" in out.stdout
    rpcnb_kernel.execute("%rpc_shutdown")
    rpcnb_kernel.execute("%rpc_init --workers 1 --no-zero-copy")
    rpcnb_kernel.execute("%%remote worker1 --push t\nt.add_(1)")
    assert rpcnb_kernel.value("t[0].item()") == 2.0
    rpcnb_kernel.execute("%rpc_shutdown")


def test_nothing_left_in_dev_shm_after_shutdown(no_api_group):
    seen = _start()
    from rpcnb.session import state

    group = state.current().group_id
    pids = [os.getpid()] + [p.pid for p in state.current().procs.values()]
    handles = zerocopy.handles()  # the group's zero copy, given back at shutdown
    try:
        a = rpc.rpc_sync("worker2", shared_of_own, args=("file_system",))
        b = torch.ones(MB)
        b.share_memory_()
        rpc.rpc_sync("worker1", keep, args=(a,))
        rpc.rpc_sync("worker2", keep, args=(b,))
        rpc.rpc_sync("worker1", keep, args=(torch.ones(MB),))  # a pool buffer too
        # torch's file-system strategy unlinks its file once no process holds the tensor
        # (its torch_shm_manager, worker2's child, counts them): the user lets go of it
        del a
    finally:
        _stop(seen)
    del b
    assert shm.leftovers(group) == []
    assert wait_until(lambda: torch_shm_files(pids) == [], timeout=10), torch_shm_files(pids)
    assert handles is not None and handles.stats()["held"] == 0
