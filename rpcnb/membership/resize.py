"""Changing a running group from the first kernel: ``restart`` replaces a dead or stuck
worker with a fresh process under the same name, GPUs and device map; ``add_workers``
starts more workers. Both run on the leader, which started the workers: in a kept group
that is the keeper, so the attached kernel asks it (the ``resize`` request).

A restarted worker is a new member of torch's group (a new rank; the old one was removed
when it died), so RRefs the old process owned are gone: ``restart`` names the ones this
notebook still holds.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from rpcnb import errors, waiting
from rpcnb.cells.output import shell
from rpcnb.errors import RpcnbError
from rpcnb.membership import collectives, start
from rpcnb.procs import launch
from rpcnb.session import protocol, roster, state
from rpcnb.session.state import Session
from rpcnb.wire import _torch, options

DECLARE_WAIT = 10.0  # seconds the death watcher gets to clean up after the old process


def _leader() -> Session:
    s = state.current()
    if not s.is_leader:
        raise RpcnbError(errors.CHANGE_NOT_LEADER.format(leader=s.leader))
    return s


def _keeper_does(s: Session, what: str, *args: Any, timeout: float) -> Any:
    """The kernel attached to a kept group asks the keeper, which started the workers, to
    change the group (``keeper_resize`` there); None on any other member."""
    if s.is_leader or not s.kept_group:
        return None
    return protocol.call(s.token, s.leader, "resize", what, *args, timeout=timeout + 30)


def keeper_resize(what: str, *args: Any) -> Any:
    """On the keeper: what the attached kernel asked (``restart`` or ``add``)."""
    if what == "restart":
        return restart(str(args[0]))
    if what == "add":
        return add_workers(int(args[0]), args[1])
    raise ValueError(f"unknown change of a group: {what!r}")


def restart(name: str, timeout: float = start.START_TIMEOUT) -> str:
    """Replace worker ``name`` (dead, stuck or alive) by a fresh process; the message
    says what was lost. Its namespace starts empty."""
    s = state.current()
    said = _keeper_does(s, "restart", name, timeout=timeout)
    if said is not None:
        lost = _rrefs_owned_by(name)  # the keeper holds no notebook's RRefs: this kernel does
        return said + (" " + errors.RREFS_LOST.format(name=name, names=", ".join(lost))
                       if lost else "")
    s = _leader()
    started = s.workers_started()
    proc, spec, known = started.get(name), s.worker_spec(name), sorted(started)
    if name == s.name:
        raise RpcnbError(errors.RESTART_SELF.format(name=name))
    collectives.refuse_resize(s, f"restarting {name}")
    if proc is None or spec is None:
        if name in s.members:
            raise RpcnbError(errors.RESTART_NOT_OURS.format(name=name))
        raise RpcnbError(errors.UNKNOWN_WORKER.format(name=name, known=", ".join(known)))
    old_pid = proc.pid
    if proc.alive():
        was = "stuck" if proc.stopped() else "running"
        proc.proc.kill()  # a stuck process may ignore SIGTERM (or be stopped)
        proc.proc.wait(5)
    else:
        was = f"dead ({proc.how_died()})"
    # the death watcher removes it from torch's group and tells all
    if not waiting.until(lambda: s.is_dead(name), DECLARE_WAIT):
        from rpcnb.membership import failures

        failures.declare(s, name, launch.how_died(proc.proc.returncode))
    s.teardown.run(start.worker_step(name))  # the old process's step: its shared memory
    lost = _rrefs_owned_by(name)
    store = _torch.store()
    rank = roster.next_rank(store)
    s.revive(name)
    roster.names_changed(s)
    new = start.start_worker(s, name, rank, spec.options, spec.env)
    s.add_worker(name, new)
    s.teardown.push(start.worker_step(name), functools.partial(start.stop_worker, s, new))
    for other in roster.live_names(s):
        if other not in (s.name, name):
            try:
                protocol.call(s.token, other, "member_back", name, timeout=5)
            except Exception:
                pass
    try:
        start.wait_ready(s, timeout, names=[name])
    except BaseException:
        s.teardown.run(start.worker_step(name))
        raise
    msg = errors.RESTARTED.format(name=name, was=was, old=old_pid, new=new.pid)
    if lost:
        msg += " " + errors.RREFS_LOST.format(name=name, names=", ".join(lost))
    return msg


def _rrefs_owned_by(name: str) -> list[str]:
    """Names in this notebook bound to RRefs that ``name`` owned (torch no longer knows
    the owner of an RRef whose process died: those count too)."""
    sh = shell()
    if sh is None:
        return []
    try:
        import torch.distributed.rpc as rpc
    except ImportError:  # pragma: no cover
        return []
    found = []
    for var, value in list(sh.user_ns.items()):
        if var.startswith("_") or not isinstance(value, rpc.PyRRef):
            continue
        try:
            owner = value.owner_name()
        except Exception:  # its owner left torch's group: the dead process
            owner = name
        if owner == name:
            found.append(var)
    return sorted(found)


def add_workers(n: int, gpus: str | None = None, timeout: float = start.START_TIMEOUT) -> list[str]:
    """Start ``n`` more workers (named after the highest ``workerK`` used so far); their
    names. ``gpus`` as for ``init``."""
    kept: list[str] | None = _keeper_does(state.current(), "add", n, gpus, timeout=timeout)
    if kept is not None:
        return kept
    s = _leader()
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(errors.ADD_COUNT.format(n=n))
    collectives.refuse_resize(s, f"adding {n} worker(s)")
    store = _torch.store()
    roster.refuse_join_while_unreachable(store)
    if any(entry.get("device_map") for entry in roster.published(store).values()):
        raise RpcnbError(errors.ADD_WITH_DEVICE_MAPS)
    used = set(s.workers_started()) | {m.name for m in s.records()}
    top = max([int(m.group(1)) for u in used if (m := re.fullmatch(r"worker(\d+)", u))],
              default=0)
    names = [f"worker{top + k}" for k in range(1, n + 1)]
    devices = options.plan_devices(s.name, names, gpus, None)
    for wname in names:
        roster.publish(store, wname, devices.devices[wname], None)
    start.launch_workers(s, names, s.options, devices)
    try:
        start.wait_ready(s, timeout, names=names)
    except BaseException:
        s.forget_workers(names)
        for w in names:  # the steps launch_workers registered for them
            s.teardown.run(start.worker_step(w))
        raise
    return names


def describe_added(names: list[str]) -> Any:
    return errors.ADDED.format(n=len(names), names=", ".join(names))
