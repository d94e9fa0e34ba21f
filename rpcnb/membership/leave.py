"""Leaving a group, always in bounded time.

A member leaves with ``leave_group`` (a graceful ``rpc.shutdown``, bounded). The leader
holds the rendezvous and leaves last: ``shutdown_group`` asks every member to leave,
stops the worker processes it started that do not, removes what is still listed from
torch's group, then leaves itself. Either way the member's teardown stack
(``rpcnb.session.teardown``) then unwinds: the same stack a failed start and the
process's exit unwind.
"""

from __future__ import annotations

import atexit
import threading

from rpcnb import waiting
from rpcnb.procs import launch
from rpcnb.session import protocol, roster, state
from rpcnb.session.state import Session
from rpcnb.wire import _torch


def local_shutdown(graceful: bool, timeout: float = 10.0) -> bool:
    """rpc.shutdown() bounded in time; True if it finished."""
    import torch.distributed.rpc as rpc

    box: dict[str, BaseException] = {}

    def target() -> None:
        try:
            rpc.shutdown(graceful=graceful, timeout=timeout)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=target, name="rpcnb-shutdown", daemon=True)
    t.start()
    t.join(timeout + 5)
    return not t.is_alive()


def leave_group(timeout: float = 10.0, graceful: bool = True, tell: bool = False) -> None:
    """This member leaves the group (the leader uses ``shutdown_group`` instead): its
    teardown stack unwinds, torch's agent leaving gracefully within ``timeout``. ``tell``:
    it leaves by itself (not asked by the leader), and the others mark it as left first."""
    s = state.active()
    if s is None:
        return
    if tell and graceful:
        roster.say_left(s)
    s.closing = True
    s.leaving = (graceful, timeout)
    s.teardown.close()


def shutdown_group(s: Session, timeout: float = 10.0) -> None:
    """On the leader: every member leaves first, then this process (see the module)."""
    s.closing = True
    if s.watcher is not None:
        s.watcher.join(1)
    # an unreachable member would not hear it: it is only removed from torch's group
    others = [n for n in roster.live_names(s) if n != s.name and not s.is_unreachable(n)]
    for name in others:
        proc = s.procs.get(name)
        if proc is not None:
            proc.left = True
            if proc.stopped():  # it cannot leave; do not wait for it
                proc.stop(grace=0.2)
        try:
            protocol.call_async(s.token, name, "leave", timeout=5)
        except Exception:
            pass
    def everyone_left() -> bool:
        gone = {n for n, w in s.procs.items() if not w.alive()}
        return not {n for n in _torch.member_names() if n != s.name and n not in gone
                    and not s.is_dead(n) and not s.is_unreachable(n)}

    deadline = waiting.Deadline.after(timeout)
    waiting.until(everyone_left, timeout, every=0.05)
    launch.wait_exit(list(s.procs.values()), max(0.5, deadline.left() or 0.0))
    for w in s.procs.values():
        if w.alive():
            w.stop(grace=1.0)
    for name in set(_torch.member_names()) - {s.name}:
        try:
            # whoever holds the group token now is gone or stuck: take it
            roster.forget(s, name, steal_any=True)
        except Exception:
            pass
    # everyone else is gone: this member leaves in order; but torch's graceful leave waits
    # for every call in flight, and a call to an unreachable member never ends: at once
    s.leaving = (not s.unreachable(), 5.0)
    s.teardown.close()


def _leave_at_exit() -> None:
    """The process is exiting while in a group (a kernel shut down or restarted without
    %rpc_shutdown): the same stack unwinds, quickly: workers stopped, torch's agent left
    at once, shared memory and the group's folder removed."""
    s = state.active()
    if s is None:
        return
    s.closing = True
    s.leaving = (False, 1.0)
    s.teardown.close()


atexit.register(_leave_at_exit)
