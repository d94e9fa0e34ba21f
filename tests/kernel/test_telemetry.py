"""Telemetry: every call recorded with peer, op, bytes, channel and duration."""

from __future__ import annotations

import sys

import cloudpickle
import torch
import torch.distributed.rpc as rpc

import rpcnb
from rpcnb import telemetry

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def size_of(t):
    return t.numel()


def _calls(tensor_bytes):
    rpc.rpc_sync("worker1", size_of, args=(torch.ones(10),))
    fut = rpc.rpc_async("worker1", size_of, args=(torch.ones(tensor_bytes // 4),))
    fut.wait()
    rref = rpc.remote("worker1", size_of, args=(torch.ones(3),))
    rref.to_here()
    rpcnb.run("worker1", "1 + 1", fetch=True)


def test_plain_rpc_calls_and_cells_are_recorded(api_group, monkeypatch):
    """While someone looks (RPCNB_CALL_TIMES=1 here; a monitor or the panel in a
    notebook), every call is timed, rpc_async and remote included."""
    monkeypatch.setenv(telemetry.TIMING_ENV, "1")
    telemetry.clear()
    _calls(4 << 20)
    recs = telemetry.records("worker1")
    ops = [r["op"] for r in recs]
    assert ops.count("size_of") == 2 and "remote:size_of" in ops and "cell" in ops
    small = next(r for r in recs if r["op"] == "size_of")
    assert small["nbytes"] == 40 and small["duration"] > 0 and small["ok"]
    shm_recs = [r for r in recs if r["channel"] == "rpcnb_shm"]
    assert len(shm_recs) == 1 and shm_recs[0]["nbytes"] == 4 << 20
    s = telemetry.summary("worker1")
    assert s["calls"] == len(recs)
    assert s["p50_ms"] <= s["p95_ms"]
    assert s["bytes"] >= (4 << 20) and s["bytes_per_s"] > 0


def test_untimed_calls_are_counted(api_group, monkeypatch):
    """Nobody looking: a plain call is only counted (timing costs every call, docs/
    benchmarks.md); a remote cell is timed all the same (%rpc_workers' "recent")."""
    monkeypatch.delenv(telemetry.TIMING_ENV, raising=False)
    assert not telemetry.timing()
    telemetry.clear()
    _calls(1024)
    recs = telemetry.records("worker1")
    ops = [r["op"] for r in recs]
    assert "size_of" not in ops and "remote:size_of" not in ops and "cell" in ops
    # counted, not timed: rpc_sync, rpc_async, remote, and the cell's own run_cell request
    assert telemetry.summary("worker1")["calls"] == len(recs) + 4


def test_ring_buffer_is_bounded():
    telemetry.clear()
    for i in range(telemetry.CAPACITY + 100):
        telemetry.record("peer", "op", 0.0, 0.001 * (i % 7))
    assert len(telemetry.records()) == telemetry.CAPACITY
    assert telemetry.summary("peer")["calls"] == telemetry.CAPACITY + 100
    telemetry.clear()


def test_a_listener_that_unsubscribes_itself_does_not_hide_the_next_one():
    # records arrive on RPC threads while listeners come and go (a monitor stopping, say):
    # every listener subscribed when a record arrives hears it
    telemetry.clear()
    heard: list[str] = []

    def once(rec):
        telemetry.unsubscribe(once)
        heard.append("once")

    def always(rec):
        heard.append("always")

    telemetry.subscribe(once)
    telemetry.subscribe(always)
    try:
        telemetry.record("peer", "op", 0.0, 0.001)
        telemetry.record("peer", "op", 0.0, 0.001)
    finally:
        telemetry.unsubscribe(once)
        telemetry.unsubscribe(always)
    assert heard == ["once", "always", "always"]
    telemetry.clear()
