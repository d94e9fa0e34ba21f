"""The group as ``%rpc_workers`` shows it: every member with host, pid, kind, devices,
whether it is alive (or how it died, or since when it is unreachable), its calls and
recent latency."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any

from rpcnb import machine, settings, telemetry
from rpcnb.paths import shm
from rpcnb.procs import processes
from rpcnb.session import protocol, roster, state
from rpcnb.session.members import Group, Status
from rpcnb.wire import _torch

ASK_S = 3.0  # how long %rpc_workers waits for each member to describe itself
BUSY_ASK_S = 1.0  # how long ask_busy waits for each member


def memory_info() -> dict[str, Any]:
    """This process's resident memory and the shared memory it holds (its pool and the
    buffers of others it maps), as %rpc_workers shows it."""
    st = shm.stats()
    return {"rss": processes.rss_bytes(), "shm": st["pool_bytes"] + st["mapped_bytes"],
            "gpu": machine.gpu_memory()}


def listen_address() -> str:
    """Where this process's TensorPipe listens, as ``ADDR (IFACE)``: the interface
    TP_SOCKET_IFNAME named when its agent started (torch keeps the first), else this
    host name's address."""
    iface = _torch.first_interface() or settings.other("TP_SOCKET_IFNAME")
    if iface:
        return f"{machine.interface_address(iface) or '?'} ({iface})"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "?"


def running_now(s: state.Session) -> dict[str, Any] | None:
    """The cell this member runs now and where it is (``CellRunner.running``), as plain
    data (its frames left out); None when it runs none."""
    found = s.runner.running() if s.runner is not None else None
    if found is None:
        return None
    said = dataclasses.asdict(found)
    said.pop("stack")
    return said


def ask_busy(s: state.Session, timeout: float = BUSY_ASK_S) -> None:
    """Ask every other live member which cell it runs now and where (the ``running``
    request, all at once): what ``group(refresh=False)`` then shows as busy, between two
    full refreshes (the panel). A member that does not answer keeps what it said last."""
    futs = protocol.ask_each(s.token, s.others(), "running", timeout=timeout)
    for name, fut in futs.items():
        try:
            busy = fut.wait()
        except Exception:
            continue
        m = s.members.get(name)
        if m is not None:
            s.note(name, m.rank, busy=busy)


def group(refresh: bool = True) -> Group:
    """The group now: every member with host, pid, devices, liveness, calls and latency.

    ``%rpc_workers`` shows it.

    Args:
        refresh: every other member is asked about itself (3 s at most); one that does not
            answer shows as "not answering" until it answers again, and one whose host
            answers nothing at all (the watcher found) as "unreachable since ...", not
            asked. False: what this
            process last heard.

    Returns:
        A ``Group``, its members ordered by rank; ``print()`` it for a table.

    Raises:
        rpcnb.RpcnbError: this process is in no group.
    """
    s = state.current()
    s.show_notices()
    admitted = set(roster.live_names(s)) | {s.name}
    infos = {w.name: w.id for w in _torch.agent().get_worker_infos() if w.name in admitted}
    futs = {}
    if refresh:
        for name in infos:
            # an unreachable member is not asked: the watcher's pings say when it is back
            if name != s.name and not s.is_dead(name) and not s.is_unreachable(name):
                try:
                    futs[name] = (time.perf_counter(), protocol.call_async(
                        s.token, name, "describe_self", timeout=ASK_S))
                except Exception:
                    pass
    for name, (t0, fut) in futs.items():
        try:
            info = fut.wait()
        except Exception as exc:
            # (one the watcher found unreachable meanwhile is shown as that)
            s.mark_silent(name, f"not answering ({(str(exc).splitlines() or [repr(exc)])[0]})")
            continue
        telemetry.record(name, "describe", telemetry.now(), time.perf_counter() - t0)
        s.note(name, infos[name], host=info["host"], pid=info["pid"], kind=info["kind"],
               devices=info["devices"], gpus=info.get("gpus", ""),
               address=info.get("address", ""), memory=info.get("memory", {}),
               busy=info.get("running"))
        s.answered(name)  # it answers (again)
    me = s.members.get(s.name)
    if me is None:
        me = s.note(s.name, s.rank, host=socket.gethostname(), pid=os.getpid(), kind="kernel",
                    devices=machine.cuda_devices())
    s.note(s.name, s.rank, address=me.address or listen_address(), memory=memory_info(),
           busy=running_now(s))
    rows = []
    for m in s.records():
        if m.name in infos or m.status is Status.DEAD:
            stats = telemetry.summary(m.name)
            s.note(m.name, m.rank, calls=stats["calls"], recent_ms=stats["recent_ms"])
            rows.append(m)
    rows.sort(key=lambda m: m.rank)
    address = str(s.connection_path) if s.connection_path else s.init_method
    return Group(s.name, s.leader, address, rows, remote=not s.one_host)
