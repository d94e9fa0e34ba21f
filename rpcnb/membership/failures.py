"""What happens when a member dies.

A crashed member of a dynamic torch RPC group stays a member: the next join fails (and
holds the membership token), and the survivors' shutdown waits ``rpc_timeout``. On the
leader, ``watch`` (thread ``rpcnb-watch``) looks every 0.2 s for worker processes it
started that exited without being asked to, and for joined kernels on this host whose
pid is gone; ``declare`` then records how it died, wakes every call waiting on it,
removes its shared memory, removes it from torch's group and tells the other members.
It is the one place that declares a death. In a joined kernel on the leader's host,
``watch_leader`` leaves the group when the leader's process is gone.
"""

from __future__ import annotations

import socket
import sys
import time
from typing import Any

from rpcnb.cells import comms
from rpcnb.membership import leave
from rpcnb.paths import shm
from rpcnb.procs import processes
from rpcnb.session import protocol, roster, state
from rpcnb.session.state import Session

POLL = 0.2  # seconds between looks
PING_EVERY = 1.0  # seconds between the pings of a member on another host
SILENT_S = 10.0  # a member on another host that answers nothing this long is dead
JOINED = ("kernel", "engine", "headless")  # members that joined by themselves
LEADER_DIED = (
    "rpcnb: {leader}, the group's first kernel, is gone, and the group with it; this kernel "
    "left too. %rpc_init starts a new group (or joins another)."
)


def watch(s: Session) -> None:
    """On the leader: notice dead members within a fraction of a second (a second or two
    on another host), and clean up."""
    host = socket.gethostname()
    pings: dict[str, tuple[float, Any]] = {}  # name -> (sent at, future)
    answered: dict[str, float] = {}
    while not s.closing:
        time.sleep(POLL)
        with s.lock:
            found = [(w.name, w.how_died()) for w in s.procs.values()
                     if not w.left and w.name not in s.dead and not w.alive()]
            joined = [(m.name, m.kind, m.pid) for m in s.members.values()
                      if m.kind in JOINED and m.name != s.name and m.alive
                      and m.host == host and m.pid and m.name not in s.dead]
            remote = [m.name for m in s.members.values()
                      if m.name != s.name and m.alive and m.host and m.host != host
                      and m.name not in s.dead and m.name not in s.procs]
        found += [(name, f"its {kind} process is gone") for name, kind, pid in joined
                  if not processes.pid_alive(pid)]
        found += _silent(s, remote, pings, answered)
        for name, how in found:
            if s.closing:
                return
            pings.pop(name, None)
            declare(s, name, how)


def _silent(s: Session, names: list[str], pings: dict[str, tuple[float, Any]],
            answered: dict[str, float]) -> list[tuple[str, str]]:
    """Members on other hosts whose ping failed (a broken connection: the process or its
    host is gone) or that answered nothing for ``SILENT_S``; pings the others again."""
    now = time.monotonic()
    dead = []
    for name in names:
        answered.setdefault(name, now)
        sent = pings.get(name)
        if sent is not None and sent[1].done():
            try:
                sent[1].wait()
                answered[name] = now
            except Exception as exc:
                if not s.closing and name not in s.dead:
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    dead.append((name, f"its connection broke ({first[:80]})"))
                    continue
            sent = None
            pings.pop(name)
        if now - answered[name] > SILENT_S:
            dead.append((name, f"it answered nothing for {SILENT_S:g} s"))
            continue
        if sent is None and now - answered[name] >= PING_EVERY:
            try:
                pings[name] = (now, protocol.call_async(s.token, name, "probe_echo", timeout=0))
            except Exception:
                pass
    return dead


def declare(s: Session, name: str, how: str) -> None:
    """``name`` died (``how``): see the module's docstring."""
    s.mark_dead(name, how)
    comms.worker_died(name)  # its widgets close in the front end
    with s.lock:
        pid = s.members[name].pid if name in s.members else None
    if pid:
        shm.remove_segments_of(pid)
    try:
        roster.forget(s, name)
    except Exception as exc:  # keep watching; report in the log
        print(f"rpcnb: could not remove {name} from the group: {exc}", file=sys.__stderr__)
    roster.broadcast_death(s, name, how)


def watch_leader(s: Session, pid: int) -> None:
    """In a joined kernel: when the first kernel dies the group cannot go on (it held the
    rendezvous); leave at once instead of failing at the next call."""
    while state.active() is s and not s.closing:
        time.sleep(0.5)
        if not processes.pid_alive(pid):
            s.mark_dead(s.leader, "its kernel process is gone")
            print(LEADER_DIED.format(leader=s.leader), file=sys.stderr)
            leave.leave_group(timeout=5, graceful=False)
            return
