"""The channel model on its own: facts in, TensorPipe's choice and the reason out; the
verbose-log reader; probe sizes; the device-map editor's model. No processes started."""

from __future__ import annotations

import dataclasses

import pytest

from rpcnb import text
from rpcnb.observe import channels, probe
from rpcnb.observe.channels import Facts, observed, predict, predict_pair

BOOT = "17b8928a-548d-4a48-a000-3503998c322f"


def member(name: str, pid: int, **changes) -> Facts:
    base = Facts(
        name=name, host="hostA", pid=pid, boot_id=BOOT, net_ns="net:[1]", pid_ns="pid:[2]",
        user_ns="user:[3]", uids=(1000, 1000, 1000), gids=(1000, 1000, 1000), dumpable=True,
        cap_permitted="0000000000000000", lsms=["capability", "yama"], ptrace_scope=1,
        cma_selftest=True, memfd=True, ibverbs=False, ib_devices=[], socket_ifname="lo",
        cuda_built=False,
    )
    return dataclasses.replace(base, **changes)


def gpus(n: int, prefix: str, p2p: bool = True) -> dict:
    devices = [{"index": i, "uuid": f"{prefix}-{i}", "name": "GPU"} for i in range(n)]
    matrix = {a["uuid"]: {b["uuid"]: (a is b or p2p) for b in devices} for a in devices}
    return {"cuda_built": True, "cuda_devices": devices, "p2p": matrix}


def test_same_host_takes_shm_and_cma_with_the_reason():
    p = predict_pair(member("a", 1), member("b", 2))
    assert p.transport.name == "shm"
    assert "same network namespace" in p.transport.reason
    cpu = p.channels["cpu->cpu"]
    assert cpu.name == "cma"
    assert cpu.reason == "cma: same host, ptrace_scope=1, uid 1000"


def test_other_network_namespace_takes_uv_but_keeps_cma():
    # cma's descriptor has no network namespace: only the transport changes
    p = predict_pair(member("a", 1), member("b", 2, net_ns="net:[9]", socket_ifname="veth1"))
    assert p.transport.name == "uv"
    assert "different network namespaces" in p.transport.reason
    assert "veth1" in p.transport.reason
    assert p.channels["cpu->cpu"].name == "cma"


def test_other_host_takes_uv_and_mpt_uv():
    p = predict_pair(member("a", 1), member("b", 2, boot_id="other", host="hostB"))
    assert p.transport.name == "uv"
    assert p.channels["cpu->cpu"].name == "mpt_uv"
    assert "cma: different hosts" in p.channels["cpu->cpu"].reason


@pytest.mark.parametrize(("change", "words"), [
    ({"ptrace_scope": 2}, "ptrace_scope=2"),
    ({"ptrace_scope": 3}, "ptrace_scope=3"),
    ({"cma_selftest": False}, "process_vm_readv is blocked"),
    ({"dumpable": False}, "not dumpable"),
    ({"uids": (1000, 0, 1000)}, "uids/gids differ"),
])
def test_cma_not_viable_falls_back_to_mpt_uv(change, words):
    p = predict_pair(member("a", 1), member("b", 2, **change))
    assert p.channels["cpu->cpu"].name == "mpt_uv"
    assert words in p.channels["cpu->cpu"].reason


def test_cma_needs_same_user_pid_namespace_and_capabilities():
    a = member("a", 1)
    assert predict_pair(a, member("b", 2, uids=(0, 0, 0), gids=(0, 0, 0))) \
        .channels["cpu->cpu"].name == "mpt_uv"
    assert predict_pair(a, member("b", 2, pid_ns="pid:[7]")).channels["cpu->cpu"].name == "mpt_uv"
    assert predict_pair(a, member("b", 2, user_ns="user:[7]")).channels["cpu->cpu"].name == "mpt_uv"
    caps = member("b", 2, cap_permitted="00000000a80425fb")
    assert "capabilities" in predict_pair(a, caps).channels["cpu->cpu"].reason
    # without the capability LSM, capabilities do not count
    no_lsm = [member(n, i, lsms=["yama"]) for n, i in (("a", 1), ("b", 2))]
    no_lsm[1] = dataclasses.replace(no_lsm[1], cap_permitted="00000000a80425fb")
    assert predict_pair(*no_lsm).channels["cpu->cpu"].name == "cma"


def test_no_yama_is_fine_and_said():
    p = predict_pair(member("a", 1, ptrace_scope=None, lsms=None),
                     member("b", 2, ptrace_scope=None, lsms=None))
    assert p.channels["cpu->cpu"].reason == "cma: same host, no yama, uid 1000"


def test_restricted_channels_follow_the_list_order_of_the_accepting_side():
    a = member("a", 1, channels=["mpt_uv", "basic"])
    b = member("b", 2, channels=["basic", "mpt_uv"])
    # the pipe a -> b is accepted by b: b's order decides
    assert predict_pair(a, b).channels["cpu->cpu"].name == "basic"
    assert predict_pair(b, a).channels["cpu->cpu"].name == "mpt_uv"
    reason = predict_pair(member("a", 1), b).channels["cpu->cpu"].reason
    assert "cma: not in b's --channels" in reason


def test_restricted_transports():
    p = predict_pair(member("a", 1, transports=["uv"]), member("b", 2, transports=["uv"]))
    assert p.transport.name == "uv"
    assert "shm: off in b: rpcnb's default transport is uv" in p.transport.reason
    q = predict_pair(member("a", 1, transports=["uv", "ibv"]),
                     member("b", 2, transports=["uv", "ibv"]))
    assert "shm: not in b's --transports" in q.transport.reason
    assert p.channels["cpu->cpu"].name == "cma"
    assert "basic: the data rides the uv" in predict_pair(
        member("a", 1, channels=["basic"], transports=["uv"]),
        member("b", 2, channels=["basic"], transports=["uv"])
    ).channels["cpu->cpu"].reason


def test_ib_transport_and_memfd():
    ib = {"ibverbs": True, "ib_devices": ["mlx5_0"]}
    p = predict_pair(member("a", 1, boot_id="x", **ib), member("b", 2, **ib))
    assert p.transport.name == "ibv"
    # between hosts CPU tensors still take mpt_uv: 1100 > basic's 1000
    assert p.channels["cpu->cpu"].name == "mpt_uv"
    p = predict_pair(member("a", 1), member("b", 2, memfd=False))
    assert p.transport.name == "uv" and "cannot map a memfd" in p.transport.reason


def test_cuda_pairs():
    a = member("a", 1, **gpus(2, "h"))
    b = member("b", 2, **gpus(2, "h"))
    a = dataclasses.replace(a, cuda_devices=a.cuda_devices, p2p=a.p2p)
    p = predict_pair(a, b)
    assert set(p.channels) == {"cpu->cpu", "cuda:0->cuda:0", "cuda:0->cuda:1",
                               "cuda:1->cuda:0", "cuda:1->cuda:1", "cpu->cuda:0",
                               "cpu->cuda:1", "cuda:0->cpu", "cuda:1->cpu"}
    # a CPU is paired with a GPU through cuda_basic, the one channel that advertises both:
    # TensorPipe opens it on every pipe between CUDA members
    assert p.channels["cpu->cuda:1"].name == p.channels["cuda:0->cpu"].name == "cuda_basic"
    assert p.channel_names() == {"cma", "cuda_ipc", "cuda_basic"}
    assert p.channels["cuda:0->cuda:1"].name == "cuda_ipc"
    assert "cuda_xth: different processes" in p.channels["cuda:0->cuda:1"].passed
    no_p2p = predict_pair(member("a", 1, **gpus(2, "h", p2p=False)),
                          member("b", 2, **gpus(2, "h", p2p=False)))
    assert no_p2p.channels["cuda:0->cuda:1"].name == "cuda_basic"
    assert no_p2p.channels["cuda:0->cuda:0"].name == "cuda_ipc"  # a GPU reaches itself
    ib = {"ibverbs": True, "ib_devices": ["mlx5_0"], "nv_peer_mem": True}
    far = predict_pair(member("a", 1, boot_id="x", **gpus(1, "x"), **ib),
                       member("b", 2, **gpus(1, "y"), **ib))
    assert far.channels["cuda:0->cuda:0"].name == "cuda_gdr"
    plain = predict_pair(member("a", 1, boot_id="x", **gpus(1, "x")), member("b", 2, **gpus(1, "y")))
    assert plain.channels["cuda:0->cuda:0"].name == "cuda_basic"
    assert "nv_peer_mem" in plain.channels["cuda:0->cuda:0"].reason
    cpu_only = predict_pair(member("a", 1, cuda_built=True), member("b", 2, **gpus(1, "h")))
    assert set(cpu_only.channels) == {"cpu->cpu"}
    # CUDA channels left out of --channels: the GPU pairs have none, and open nothing
    restricted = predict_pair(member("a", 1, channels=["cma", "basic"], **gpus(1, "h")),
                              member("b", 2, channels=["cma", "basic"], **gpus(1, "h")))
    assert restricted.channels["cuda:0->cuda:0"].name == "none"
    assert "cpu->cuda:0" not in restricted.channels
    assert restricted.channel_names() == {"cma"}


def test_predict_covers_every_ordered_pair_and_serialises():
    facts = {n: member(n, i) for i, n in enumerate(["w0", "w1", "w2"])}
    preds = predict(facts)
    assert set(preds) == {(a, b) for a in facts for b in facts if a != b}
    d = preds[("w0", "w1")].to_dict()
    assert d["transport"]["name"] == "shm" and d["channels"]["cpu->cpu"]["name"] == "cma"
    assert Facts.from_dict(facts["w0"].to_dict()) == facts["w0"]
    text = channels.describe(preds)
    assert "w0" in text and "cma: same host" in text


def test_local_facts_read_this_process():
    import os

    f = Facts.from_dict(channels.local_facts())
    assert f.pid == os.getpid()
    assert f.boot_id and f.net_ns.startswith("net:[")
    assert f.uids == os.getresuid()
    assert isinstance(f.cma_selftest, bool) and f.memfd
    from rpcnb import machine

    assert machine.cma_selftest() == f.cma_selftest


LOG = """\
V 609 tp/conn.h:421] Connection w1.tr_uv.c0 was renamed to w1_to_w0.d.tr_uv
V 610 tp/chan.h:250] Channel w1.ch_cma.c0 was renamed to w1_to_w0.ch_cma
V 611 tp/conn.h:421] Connection w1.tr_shm.c0 was renamed to w1_to_w0.d.tr_shm
V 612 tp/conn.h:421] Connection w1.tr_shm.c1 was renamed to w1_to_w0.r.tr_shm
V 613 tp/conn.h:421] Connection w1.tr_shm.c2 was renamed to w1_to_w0.ch_cma_0
V 769 tp/conn.h:421] Connection w1[l0].tr_uv.c0 was renamed to w1[l0]_from_w_0.d.tr_uv
V 921 tp/chan.h:250] Channel w1.ch_mpt_uv.c1 was renamed to w1[l0]_from_w_0.ch_mpt_uv
V 950 tp/chan.h:218] Channel w1[l0]_from_w_0.ch_mpt_uv received a recv request (#0)
"""


def test_observed_reads_pipes_transports_and_channels():
    seen = observed(LOG)
    assert seen[("w1", "w0")] == {"transport": "shm", "channels": {"cma"}}
    # an accepted pipe runs from the peer to this process; names may hold '_'
    assert seen[("w_0", "w1")] == {"transport": "uv", "channels": {"mpt_uv"}}


@pytest.mark.parametrize(("text", "value"), [("1K", 1024), ("256M", 256 << 20), ("4096", 4096),
                                             ("1.5KB", 1536), ("2g", 2 << 30)])
def test_probe_sizes(text, value):
    assert probe.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "K", "-1K", "12Q", "abc"])
def test_probe_bad_sizes(text):
    with pytest.raises(ValueError, match="is not a size"):
        probe.parse_size(text)


def test_probe_formats():
    assert text.size(1 << 20, decimals=None) == "1 MB"
    assert text.size(1536, decimals=None) == "1.5 KB"
    assert probe.format_rate(2.5e9) == "2.50 GB/s"
    assert probe.format_rate(3.2e6) == "3.2 MB/s"
    assert probe.DEFAULT_SIZES[0] == 1 << 10 and probe.DEFAULT_SIZES[-1] == 256 << 20


def test_devmap_editor_model_validates_as_the_user_edits():
    pytest.importorskip("anywidget")
    from rpcnb.frontend import widgets
    from rpcnb.frontend.widgets.devmap_editor import (
        APPLIED,
        NOT_APPLIED,
        DeviceMapEditor,
        parse_topology,
    )

    assert parse_topology("w0=2,w1=1") == {"w0": ["cuda:0", "cuda:1"], "w1": ["cuda:0"]}
    assert parse_topology({"w0": ["cuda:1"]}) == {"w0": ["cuda:1"]}
    with pytest.raises(ValueError, match="is not a topology"):
        parse_topology("w0:2")
    ed = DeviceMapEditor(topology="worker0=2,worker1=2,worker2=1")
    assert ed.me == "worker0" and ed.local_devices == ["cuda:0", "cuda:1"]
    assert [p["name"] for p in ed.peers] == ["worker1", "worker2"]
    assert ed.problems == [] and ed.forms["python"] == "# no device map"
    ed.mapping = {"worker1": {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}, "worker2": {}}
    assert ed.problems == []
    assert ed.forms["string"] == "1_0_1,1_1_0"
    assert "set_device_map('worker1'" in ed.forms["python"]
    ed.apply()
    assert ed.applied == APPLIED
    assert widgets.applied_device_map() == {"worker1": {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}}
    ed.mapping = {"worker1": {"cuda:0": "cuda:0", "cuda:1": "cuda:0"}, "worker2": {"cuda:1": "cuda:0"}}
    messages = [p["message"] for p in ed.problems]
    assert any(m.startswith("duplicated target device") for m in messages)
    with pytest.raises(ValueError, match="fix the problems"):
        ed.apply()
    assert ed.applied == NOT_APPLIED
    ed.mapping = {"worker2": {"cuda:0": "cuda:1"}}  # worker2 has one GPU
    assert "worker2 has only 1 CUDA device" in ed.problems[0]["message"]
    widgets.keep_device_map(None)
    assert widgets.applied_device_map() is None
