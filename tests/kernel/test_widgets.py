"""The channel monitor and the device-map editor in a real kernel with a live group:
what they hold, that the monitor updates while calls happen and stops on %rpc_shutdown,
and that an applied device map is the one the next %rpc_init uses."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("anywidget")


def wait_for(kernel, expr: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = kernel.value(expr)
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.3)


def test_channel_monitor_live_then_stopped(own_group):
    out = own_group.execute("import rpcnb\nmon = %rpc_channels\nmon")
    assert any("application/vnd.jupyter.widget-view+json" in r for r in out.results)
    cell = own_group.value("mon.matrix['worker1->worker2']")
    assert (cell["transport"], cell["channel"]) == ("uv", "cma")  # uv: rpcnb's default
    assert cell["reason"].startswith("uv: TCP") and "cma: same host" in cell["reason"]
    assert "rpcnb's default transport is uv" in cell["reason"]
    assert own_group.value("sorted(mon.members)") == ["worker0", "worker1", "worker2"]
    before = own_group.value("mon.updates")
    own_group.execute("for _ in range(5):\n    rpcnb.run('worker1', '1 + 1')")
    own_group.execute("%remote worker1 import torch, torch.distributed.rpc as rpc; "
                  "rpc.rpc_sync('worker2', torch.add, args=(torch.ones(4), 1))")
    assert wait_for(own_group, f"mon.updates > {before} and mon.matrix['worker0->worker1']['calls'] >= 5")
    assert own_group.value("len(mon.series['worker1'])") >= 5
    assert own_group.value("mon.matrix['worker0->worker1']['p50_ms'] > 0")
    # worker1's own calls to worker2 come from worker1's telemetry, asked over RPC
    assert wait_for(own_group, "mon.matrix['worker1->worker2']['calls'] >= 1")
    own_group.execute("%rpc_probe worker1 --sizes 1K,1M --repeats 1")
    assert wait_for(own_group, "len(mon.curve.get('worker1', [])) == 2")
    assert own_group.value("mon.status") == "live"
    own_group.execute("%rpc_shutdown")
    assert wait_for(own_group, "mon.status.startswith('stopped')", timeout=10)
    # no more pushes after the group is gone: its updating thread has ended, and the
    # count it left stays
    updates = own_group.value("mon.updates")
    assert wait_for(own_group, "not [t for t in __import__('threading').enumerate() "
                               "if t.name == 'rpcnb-channel-monitor']")
    assert own_group.value("mon.updates") == updates


def test_channel_monitor_text_form(group):
    out = group.execute("%rpc_channels --text")
    assert "worker0" in out.stdout and "cma: same host" in out.stdout


def test_devmap_editor_live_group_and_apply(own_group):
    out = own_group.execute("ed = %rpc_devmap\ned")
    assert any("application/vnd.jupyter.widget-view+json" in r for r in out.results)
    assert own_group.value("ed.source") == "live group"
    assert own_group.value("[p['name'] for p in ed.peers]") == ["worker1", "worker2"]
    gpus = __import__("torch").cuda.device_count()
    assert own_group.value("ed.local_devices") == [f"cuda:{i}" for i in range(gpus)]
    own_group.execute("ed = %rpc_devmap --topology worker0=2,worker1=2,worker2=1")
    assert own_group.value("ed.source") == "live group with a declared topology"
    assert own_group.value("ed.problems") == []
    own_group.execute("ed.mapping = {'worker1': {'cuda:0': 'cuda:1', 'cuda:1': 'cuda:1'}}")
    assert "duplicated target device" in own_group.value("ed.problems[0]['message']")
    own_group.execute("ed.mapping = {'worker1': {'cuda:0': 'cuda:1'}}")
    assert own_group.value("ed.problems") == []
    assert own_group.value("ed.forms['string']") == "1_0_1"
    own_group.execute("ed.apply()")
    assert own_group.value("__import__('rpcnb.frontend.widgets').frontend.widgets.applied_device_map()") == {
        "worker1": {"cuda:0": "cuda:1"}}
    own_group.execute("%rpc_shutdown")
    # the next %rpc_init uses the applied map, and checks it against every member's GPUs
    out = own_group.execute("%rpc_init --workers 1", allow_error=gpus < 2)
    if gpus == 0:
        assert "this machine has no CUDA devices" in out.traceback
    elif gpus == 1:
        assert "worker1 has only 1 CUDA device" in out.traceback
    else:  # the map is valid here: the group starts with it
        assert "rpcnb group of 2" in out.stdout
        own_group.execute("%rpc_shutdown")
    # an explicit --device-map wins over the applied one
    out = own_group.execute("%rpc_init --workers 1 --device-map '{}'")
    assert "rpcnb group of 2" in out.stdout
    own_group.execute("%rpc_shutdown")


def test_devmap_editor_without_a_group(rpcnb_kernel):
    out = rpcnb_kernel.execute("%rpc_devmap", allow_error=True)
    assert "run %rpc_init first, or declare the members" in out.traceback
    rpcnb_kernel.execute("ed = %rpc_devmap --topology worker0=1,worker1=1 --name worker1")
    assert rpcnb_kernel.value("(ed.me, ed.local_devices, ed.source)") == (
        "worker1", ["cuda:0"], "declared topology")
