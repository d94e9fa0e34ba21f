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

from rpcnb import launch, leave, roster, shm, state
from rpcnb.state import Session

POLL = 0.2  # seconds between looks
LEADER_DIED = (
    "rpcnb: {leader}, the group's first kernel, is gone, and the group with it; this kernel "
    "left too. %rpc_init starts a new group (or joins another)."
)


def watch(s: Session) -> None:
    """On the leader: notice dead members within a fraction of a second, and clean up."""
    host = socket.gethostname()
    while not s.closing:
        time.sleep(POLL)
        with s.lock:
            found = [(w.name, w.how_died()) for w in s.procs.values()
                     if not w.left and w.name not in s.dead and not w.alive()]
            kernels = [(m.name, m.pid) for m in s.members.values()
                       if m.kind == "kernel" and m.name != s.name and m.alive
                       and m.host == host and m.pid and m.name not in s.dead]
        found += [(name, "its kernel process is gone") for name, pid in kernels
                  if not launch.pid_alive(pid)]
        for name, how in found:
            if s.closing:
                return
            declare(s, name, how)


def declare(s: Session, name: str, how: str) -> None:
    """``name`` died (``how``): see the module's docstring."""
    s.mark_dead(name, how)
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
        if not launch.pid_alive(pid):
            s.mark_dead(s.leader, "its kernel process is gone")
            print(LEADER_DIED.format(leader=s.leader), file=sys.stderr)
            leave.leave_group(timeout=5, graceful=False)
            return
