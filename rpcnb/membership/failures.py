"""What happens when a member dies.

A crashed member of a dynamic torch RPC group stays a member: the next join fails (and
holds the membership token), and the survivors' shutdown waits ``rpc_timeout``. On the
leader, ``watch`` (thread ``rpcnb-watch``) looks every 0.2 s for worker processes it
started that exited without being asked to, for joined kernels on this host whose pid is
gone, and pings every member that joined by itself (``Reach``: a closed connection is a
death, a host that answers nothing at all is a partition or a lost host, marked
unreachable and not declared dead); ``declare`` then records how it died, wakes every
call waiting on it, removes its shared memory, removes it from torch's group and tells
the other members. It is the one place that declares a death. In a joined kernel on the
leader's host, ``watch_leader`` leaves the group when the leader's process is gone.
"""

from __future__ import annotations

import socket
import sys
import time
from typing import Any

from rpcnb import machine
from rpcnb.cells import comms
from rpcnb.membership import leave
from rpcnb.paths import shm
from rpcnb.procs import processes
from rpcnb.session import protocol, roster, state
from rpcnb.session.members import Status
from rpcnb.session.state import Session
from rpcnb.wire import _torch

POLL = 0.2  # seconds between looks
PING_EVERY = 1.0  # seconds between the pings of a member that joined by itself
PING_TIMEOUT = 30.0  # a ping unanswered this long is given up (it never means death)
ANSWERS_AGAIN = ("rpcnb: {name} answers again, with its namespace: it was unreachable since "
                 "{since} ({seconds:.0f} s). A cell it was running then may have gone on there.")
UNREACHABLE_S = 4.0  # a member whose host sent nothing this long is unreachable
JOINED = ("kernel", "engine", "headless")  # members that joined by themselves
LEADER_DIED = (
    "rpcnb: {leader}, the group's first kernel, is gone, and the group with it; this kernel "
    "left too. %rpc_init starts a new group (or joins another)."
)
# words of a failed call that say the network is in the way, not that the peer is gone
NETWORK_WORDS = ("timeout", "timed out", "unreachable", "no route")


def process_gone(exc: BaseException) -> bool:
    """Whether a failed call says the peer's process is gone (its host answered: the
    connection was closed, reset or refused) rather than that nothing came back."""
    said = str(exc).lower()
    return not any(word in said for word in NETWORK_WORDS)


def host_of(address: str) -> str:
    """The address part of a member's ``ADDR (IFACE)`` (what ``view`` shows), or ''."""
    head = address.split(" ", 1)[0]
    return "" if head in ("", "?", "-") else head


def watch(s: Session) -> None:
    """On the leader: notice dead members within a fraction of a second (a second or two
    on another host), unreachable ones within ``UNREACHABLE_S``, and clean up."""
    host = socket.gethostname()
    reach: dict[str, Reach] = {}
    while not s.closing:
        time.sleep(POLL)
        started, members = s.workers_started(), s.records()
        found = [(w.name, w.how_died()) for w in started.values()
                 if not w.left and not s.is_dead(w.name) and not w.alive()]
        joined = [(m.name, m.kind, m.pid) for m in members
                  if m.kind in JOINED and m.name != s.name and m.alive
                  and m.host == host and m.pid]
        pinged = [(m.name, host_of(m.address)) for m in members
                  if m.name != s.name and m.status is not Status.DEAD and m.name not in started]
        found += [(name, f"its {kind} process is gone") for name, kind, pid in joined
                  if not processes.pid_alive(pid)]
        watched = {name for name, _, _ in joined}  # their pid says how they died
        for name, address in pinged:
            how = reach.setdefault(name, Reach(name, address)).look(s)
            if how and name not in watched:
                found.append((name, how))
        for name in set(reach) - {n for n, _ in pinged}:
            del reach[name]
        for name, how in found:
            if s.closing:
                return
            if s.is_dead(name):
                continue
            reach.pop(name, None)
            if s.reachable(name) is not None:
                _publish(s)
            declare(s, name, how)


class Reach:
    """Whether a member that joined by itself (it may be on another host: no pid to watch)
    is alive, unreachable or gone. A ping goes every ``PING_EVERY``; an answer means alive.
    A ping that fails because the connection closed means the member's host answered that
    the process is gone: dead. Pings that get no answer for ``UNREACHABLE_S`` are asked
    about at the network level (``machine.heard_from``): when the member's host has not
    even acknowledged what was sent, it is unreachable (a partition, a lost host), which
    is not a death: the member keeps its place and its namespace and is back when it
    answers. A host that acknowledges but a member that does not answer is busy, not
    unreachable (a slow link carrying a large transfer, a stopped process)."""

    def __init__(self, name: str, address: str) -> None:
        self.name = name
        self.address = address
        self.answered = time.monotonic()
        self.sent_at = 0.0
        self.pings: list[Any] = []

    def look(self, s: Session) -> str | None:
        """One look: how it died, or None (its unreachable mark set or cleared)."""
        now = time.monotonic()
        for fut in [f for f in self.pings if f.done()]:
            self.pings.remove(fut)
            try:
                fut.wait()
                self.answered = now
            except Exception as exc:
                if process_gone(exc) and not s.closing and not s.is_dead(self.name):
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    return f"its connection broke ({first[:80]})"
        if now - self.sent_at >= PING_EVERY:
            self.sent_at = now
            try:
                self.pings.append(protocol.call_async(s.token, self.name, "probe_echo",
                                                      timeout=PING_TIMEOUT))
            except Exception:
                pass
        silent = now - self.answered
        if silent < UNREACHABLE_S:
            since = s.reachable(self.name)
            if since is not None:
                s.notice(ANSWERS_AGAIN.format(
                    name=self.name, since=time.strftime("%H:%M:%S", time.localtime(since)),
                    seconds=max(0.0, time.time() - since)))
                _publish(s)
            return None
        heard = machine.heard_from(self.address) if self.address else None
        if heard is not None and heard < UNREACHABLE_S:
            return None  # its host acknowledges: busy, not cut off
        if not s.is_unreachable(self.name):
            quiet = silent if heard is None else min(silent, heard)
            s.mark_unreachable(self.name, time.time() - quiet)
            _publish(s)
        return None


def _publish(s: Session) -> None:
    """Who is unreachable, in the store for joiners (``roster.refuse_join_while_unreachable``)."""
    try:
        roster.publish_unreachable(s, _torch.store())
    except Exception:  # the group is ending: nobody joins it any more
        pass


def declare(s: Session, name: str, how: str) -> None:
    """``name`` died (``how``): see the module's docstring."""
    s.mark_dead(name, how)
    comms.worker_died(name)  # its widgets close in the front end
    m = s.members.get(name)
    pid = m.pid if m is not None else None
    # which process of that name died: %rpc_restart may admit a new one meanwhile
    rank = m.rank if m is not None else -1
    if pid:
        shm.remove_segments_of(pid)
    try:
        roster.forget(s, name)
    except Exception as exc:  # keep watching; report in the log
        print(f"rpcnb: could not remove {name} from the group: {exc}", file=sys.__stderr__)
    roster.member_gone(s, name)
    roster.broadcast_death(s, name, how, rank)


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
