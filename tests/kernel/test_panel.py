"""The kernel's side of the JupyterLab panel (rpcnb/frontend/panel.py), driven over a real
kernel's comm channel as the extension drives it: a comm to ``rpcnb.panel`` gets
snapshots of the group; the status item's "summary" leaves out the costly parts; a killed
worker shows dead within 5 s; actions answer with a line; nothing new listens."""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from queue import Empty
from typing import Any

from conftest import listening_addresses, worker_pids

from rpcnb.frontend import panel, panel_actions


def open_comm(kernel, detail: str = "full") -> str:
    comm_id = uuid.uuid4().hex
    kc = kernel.kc
    kc.shell_channel.send(kc.session.msg("comm_open", {
        "comm_id": comm_id, "target_name": panel.TARGET, "data": {"detail": detail}}))
    return comm_id


def send(kernel, comm_id: str, data: dict[str, Any]) -> None:
    kc = kernel.kc
    kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data}))


def close_comm(kernel, comm_id: str) -> None:
    kc = kernel.kc
    kc.shell_channel.send(kc.session.msg("comm_close", {"comm_id": comm_id, "data": {}}))


def wait_for(kernel, comm_id: str, pred, timeout: float = 30) -> dict[str, Any]:
    """The first comm message's data that ``pred`` accepts."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=0.2)
        except Empty:
            continue
        if msg["msg_type"] == "comm_close" and msg["content"]["comm_id"] == comm_id:
            raise AssertionError("the kernel closed the panel's comm")
        if msg["msg_type"] != "comm_msg" or msg["content"]["comm_id"] != comm_id:
            continue
        data = msg["content"]["data"]
        seen.append(data)
        if pred(data):
            return data
    raise AssertionError(f"no matching message in {timeout} s; saw {seen[-3:]}")


def snapshot_where(pred):
    return lambda d: d.get("type") == "snapshot" and pred(d["snapshot"])


def test_without_rpcnb_the_comm_is_refused(kernel):
    comm_id = open_comm(kernel)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=0.2)
        except Empty:
            continue
        if msg["msg_type"] == "comm_close" and msg["content"]["comm_id"] == comm_id:
            return  # the extension shows "rpcnb is not loaded in this kernel"
    raise AssertionError("the kernel did not close a comm to an unknown target")


def test_no_group_then_a_group_then_a_death(kernel):
    kernel.execute("%load_ext rpcnb")
    before = sorted(listening_addresses(kernel.pid))
    comm_id = open_comm(kernel)
    snap = wait_for(kernel, comm_id, snapshot_where(lambda s: True))["snapshot"]
    assert snap["group"] is None and snap["message"] == panel.NO_GROUP
    assert snap["protocol"] == panel.PROTOCOL
    # the panel's threads run now, and the kernel listens on nothing new
    assert sorted(listening_addresses(kernel.pid)) == before

    kernel.execute("%rpc_init --workers 2")
    snap = wait_for(kernel, comm_id, snapshot_where(lambda s: s["group"] is not None))["snapshot"]
    assert [m["name"] for m in snap["members"]] == ["worker0", "worker1", "worker2"]
    assert [m["kind"] for m in snap["members"]] == ["kernel", "process", "process"]
    assert all(m["alive"] for m in snap["members"])
    assert snap["group"]["size"] == 3 and snap["group"]["me"] == "worker0"
    assert "traffic" in snap and "rrefs" in snap
    pids = worker_pids(kernel)
    assert {m["name"]: m["pid"] for m in snap["members"]} == pids

    # the channel matrix names the paths that carried tensors (the panel shows them under
    # TensorPipe's transport / channel): here rpcnb's shared memory, and no UCX
    kernel.execute("import torch\nt = torch.ones(1024, 1024)")
    kernel.execute("%%remote worker1 --push t --fetch\nt.sum().item()")
    # the snapshots sent while the cell ran went to its reader: ask for the picture again
    send(kernel, comm_id, {"type": "watch", "detail": "full"})
    snap = wait_for(kernel, comm_id, snapshot_where(
        lambda s: "rpcnb_shm" in s["traffic"]["matrix"]["worker0->worker1"]["paths"]))["snapshot"]
    cell = snap["traffic"]["matrix"]["worker0->worker1"]
    assert cell["paths"]["rpcnb_shm"] == {"tensors": 1, "bytes": 4 << 20}
    assert cell["ucx"] is None and cell["transport"] and cell["channel"]
    assert snap["traffic"]["matrix"]["worker0->worker2"]["paths"] == {}

    # the status item's level: the counts, none of the costly parts
    send(kernel, comm_id, {"type": "watch", "detail": "summary"})
    snap = wait_for(kernel, comm_id, snapshot_where(lambda s: "rrefs" not in s))["snapshot"]
    assert snap["group"]["alive"] == 3 and "traffic" not in snap

    os.kill(pids["worker2"], signal.SIGKILL)
    killed = time.monotonic()
    snap = wait_for(kernel, comm_id, snapshot_where(
        lambda s: s["group"] and s["group"]["alive"] == 2), timeout=10)["snapshot"]
    seen = time.monotonic() - killed
    dead = [m for m in snap["members"] if not m["alive"]]
    assert [m["name"] for m in dead] == ["worker2"] and "SIGKILL" in dead[0]["how"]
    assert seen < 5, f"the death reached the panel after {seen:.1f} s"

    # actions answer with a line the panel shows
    send(kernel, comm_id, {"type": "action", "action": "free", "key": "nothing", "id": 7})
    reply = wait_for(kernel, comm_id, lambda d: d.get("type") == "reply")
    assert reply == {"type": "reply", "id": 7, "ok": False, "message": panel_actions.GONE}
    send(kernel, comm_id, {"type": "action", "action": "fetch", "key": "k", "name": "1x", "id": 8})
    reply = wait_for(kernel, comm_id, lambda d: d.get("type") == "reply")
    assert reply["message"] == panel_actions.BAD_VARIABLE.format(name="1x")
    send(kernel, comm_id, {"type": "action", "action": "shutdown", "id": 9})
    reply = wait_for(kernel, comm_id, lambda d: d.get("type") == "reply", timeout=60)
    assert reply["ok"], reply
    snap = wait_for(kernel, comm_id, snapshot_where(lambda s: s["group"] is None))["snapshot"]
    assert snap["message"] == panel.NO_GROUP

    close_comm(kernel, comm_id)
    deadline = time.monotonic() + 10
    while kernel.value("__import__('rpcnb.frontend.panel').frontend.panel.publisher().thread is not None"):
        assert time.monotonic() < deadline, "the panel's thread outlived its last comm"
        time.sleep(0.5)


def test_the_panel_starts_and_shuts_down_a_group(kernel):
    kernel.execute("%load_ext rpcnb")
    comm_id = open_comm(kernel)
    wait_for(kernel, comm_id, snapshot_where(lambda s: s["group"] is None))
    send(kernel, comm_id, {"type": "action", "action": "start", "workers": "1", "id": 1})
    reply = wait_for(kernel, comm_id, lambda d: d.get("type") == "reply", timeout=90)
    assert reply["ok"] and reply["message"].startswith("started: worker0, worker1"), reply
    wait_for(kernel, comm_id, snapshot_where(lambda s: s["group"] and s["group"]["size"] == 2))
    kernel.known.update(worker_pids(kernel).values())
    send(kernel, comm_id, {"type": "action", "action": "probe", "id": 3})
    reply = wait_for(kernel, comm_id, lambda d: d.get("type") == "reply", timeout=90)
    assert reply["ok"] and re.match(r"probed: worker1 [\d.]+ ms$", reply["message"]), reply
    send(kernel, comm_id, {"type": "action", "action": "shutdown", "id": 2})
    try:
        reply = wait_for(kernel, comm_id, lambda d: d.get("type") == "reply", timeout=60)
    except AssertionError:
        print(kernel.execute("import sys, traceback\nfor t, f in sys._current_frames().items():\n"
                             "    print(t, ''.join(traceback.format_stack(f)[-8:]))").stdout)
        raise
    assert reply["ok"], reply
    wait_for(kernel, comm_id, snapshot_where(lambda s: s["group"] is None))
