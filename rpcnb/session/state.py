"""This process's membership in a group, as one object: who it is, who the others are,
which of them died or cannot be reached, its calls in flight, the processes it started.

RPC threads, the death watcher and the notebook's thread all read and write it, so every
mutable field is touched under ``Session.lock``. ``current()`` is the session of this
process (one group at a time); ``verified(token)`` is how every request from another
member is let in.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rpcnb import errors, text
from rpcnb.errors import RpcnbError
from rpcnb.procs import launch
from rpcnb.session import rendezvous
from rpcnb.session.teardown import Teardown

ALL = "--all"


@dataclass
class Member:
    """What rpcnb knows about one member of the group."""

    name: str
    rank: int
    host: str = ""
    pid: int | None = None
    kind: str = "process"  # "process" (started by rpcnb), "kernel", "engine" or "headless"
    devices: list[str] = field(default_factory=list)
    gpus: str = ""  # its CUDA_VISIBLE_DEVICES, when rpcnb gave it some (--gpus)
    alive: bool = True
    how: str = ""  # how it died or left, or why it does not answer
    calls: int = 0
    recent_ms: float | None = None
    memory: dict[str, Any] = field(default_factory=dict)  # rss, shm (bytes), gpu (a list)
    address: str = ""  # where its TensorPipe listens: "ADDR (IFACE)"
    unreachable: str = ""  # "since 14:02:11 (12 s)" while its host answers nothing
    # the cell it runs now (rpcnb.membership.start.running_now: cell, first, since, seconds,
    # file, line, text), or None when idle or not known
    busy: dict[str, Any] | None = None


@dataclass
class Group:
    """The group as seen from this process; ``print()`` it for a table.

    ``rpcnb.group()``, ``init``, ``join`` and ``%rpc_workers`` return one.

    Attributes:
        me: this process's name in the group.
        leader: the name of the group's first kernel, which holds the rendezvous.
        address: the connection file (or ``tcp://`` address) another kernel joins with.
        members: one ``Member`` per member, by rank: name, rank, host, pid, kind,
            devices, alive (or how it died), calls and recent latency.
        remote: whether the group is reachable from other hosts (``allow_remote``).
    """

    me: str
    leader: str
    address: str  # the connection file (or tcp:// address) another kernel joins with
    members: list[Member]
    remote: bool = False  # reachable from other hosts (--allow-remote)

    @property
    def join_line(self) -> str:
        """The line another kernel on this host runs to join."""
        return f"%rpc_init --join {self.address} --name NAME"

    def table(self) -> str:
        """The members as a plain-text table."""
        rows = [("name", "rank", "host", "address", "pid", "kind", "devices", "alive", "busy",
                 "calls", "recent", "memory", "gpu memory")]
        for m in self.members:
            rows.append((
                m.name + (" (this kernel)" if m.name == self.me else ""),
                str(m.rank), m.host, m.address or "-", str(m.pid or "-"), m.kind,
                (",".join(m.devices) or "cpu") + (f" (GPU {m.gpus})" if m.gpus else ""),
                f"unreachable {m.unreachable}" if m.unreachable
                else "yes" if m.alive else f"no: {m.how}",
                ("yes" if m.busy else "no") if m.alive and not m.unreachable else "-",
                str(m.calls),
                "-" if m.recent_ms is None else f"{m.recent_ms:.2f} ms",
                _memory(m.memory),
                gpu_memory(m.memory),
            ))
        return text.table(rows)

    def busy(self) -> str:
        """A line per busy member: the cell, since when, and where it is now."""
        return "\n".join(busy_line(m.name, m.busy) for m in self.members
                         if m.busy and m.alive and not m.unreachable)

    def __str__(self) -> str:
        busy = self.busy()
        return (f"rpcnb group of {sum(m.alive for m in self.members)} "
                f"(this process is {self.me}, {self.leader} holds the rendezvous)\n"
                f"{self.table()}\n" + (f"{busy}\n" if busy else "") +
                f"Join from another kernel on this host:\n  {self.join_line}"
                + ("\nFrom another host: %rpc_init --join tcp://HOST:PORT --token TOKEN "
                   "--name NAME (the token is in the connection file)" if self.remote else ""))

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def busy_line(name: str, busy: dict[str, Any]) -> str:
    """``worker1 runs <worker1 cell 3> (for i in range(9):) since 14:02:11 (12 s), at line 4:
    time.sleep(1)``: what a busy member runs, and where it is now."""
    since = time.strftime("%H:%M:%S", time.localtime(busy["since"]))
    now = where(busy)
    first = busy.get("first", "")
    first = first if len(first) <= 40 else first[:37] + "..."
    seconds = max(0.0, time.time() - busy["since"])
    return (f"{name} runs {busy['cell']} ({first}) since {since} ({seconds:.0f} s)"
            + (f", at {now}" if now else ""))


def where(busy: dict[str, Any]) -> str:
    """Where a busy member's cell is now: ``line 4: time.sleep(1)``, ``line 2 of <worker1
    cell 1>: ...`` in a function of an earlier cell; "" when it is in none of the cells'
    code (rpcnb's own, as the cell starts or ends)."""
    if not busy.get("file"):
        return ""
    of = "" if busy["file"] == busy.get("cell") else f" of {busy['file']}"
    return f"line {busy['line']}{of}: {busy['text']}"


def gpu_memory(memory: dict[str, Any]) -> str:
    """``cuda:0 1.2 GB alloc / 2.0 GB reserved / 79.6 GB``, per device; ``no GPU``."""
    if not memory:
        return "-"
    gpus = memory.get("gpu") or []
    if not gpus:
        return "no GPU"
    said = []
    for g in gpus:
        total = "CUDA not initialised" if g.get("total") is None else text.size(g["total"])
        said.append(f"{g['device']} {text.size(g['allocated'])} alloc / "
                    f"{text.size(g['reserved'])} reserved / {total}")
    return "; ".join(said)


def _memory(memory: dict[str, Any]) -> str:
    if not memory:
        return "-"
    said = text.size(memory.get("rss", 0), "MB", 0)
    if memory.get("shm"):
        said += f" (shm {text.size(memory['shm'], 'MB', 0)})"
    return said


class DataPaths(Protocol):
    """The group's data paths as its session holds them (``Session.paths``): an
    ``rpcnb.paths.routes.Paths``, made when this member starts and given back by the
    teardown once torch's agent has left. ``session/`` sits below ``paths/``, so this
    names what the paths read of it."""

    shm: Any  # rpcnb.paths.shm.Pool: shared memory in a group on one host, else None
    zero_copy: Any  # rpcnb.paths.zerocopy.Handles: tensors already shared, sent by handle
    ucx: Any  # rpcnb.paths.ucx.Link: UCX, in a group that asked for it, else None


class Session:
    """This process's part in one group (see the module's docstring)."""

    def __init__(self, name: str, rank: int, leader: str, init_method: str,
                 options: dict[str, Any], secret: str, *, runner: Any = None,
                 group_dir: Path | None = None, teardown: Teardown | None = None) -> None:
        self.name = name
        self.rank = rank
        self.leader = leader
        self.init_method = init_method
        self.options = options
        self.secret = secret
        self.token = rendezvous.call_token(secret)
        self.sign_key = rendezvous.sign_key(secret)  # Python payloads are signed with it
        self.group_id = rendezvous.Connection(init_method, "", "").group_id
        self.runner = runner  # runs the remote cells sent to this member
        self.group_dir = group_dir  # only on the leader, which owns it
        self.connection_path: Path | None = None
        self.listen: tuple[str, int] | None = None  # a TCP store this process serves
        # what this member set up, each with its cleanup: every way out unwinds it
        self.teardown = teardown if teardown is not None else Teardown()
        # how torch's RPC agent is left when the stack unwinds: gracefully (everyone else
        # has left, or this member leaves in order) within a time limit, or at once
        self.leaving: tuple[bool, float] = (False, 5.0)
        self.lock = threading.RLock()
        self.procs: dict[str, launch.LocalWorker] = {}  # workers this process started
        # how each of them was started (options, environment): %rpc_restart starts it again
        self.specs: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}
        self.members: dict[str, Member] = {}  # admitted members (they know the secret)
        self.dead: dict[str, str] = {}  # name -> how it died or left; names are not reused
        # name -> since when (wall clock) its host has sent nothing (failures.watch says)
        self.unreachable: dict[str, float] = {}
        self.calls: dict[str, Any] = {}  # call id -> a remote cell this process waits for
        # member -> plain torch calls to it in flight (paths.calls.InFlight; across hosts)
        self.in_flight: dict[str, set[Any]] = {}
        self.background: dict[int, Any] = {}  # id -> a background cell this process sent
        self.jobs_started = 0  # background cells sent so far (their ids count up)
        self.facts: dict[str, dict[str, Any]] = {}  # name -> channel facts it reported
        self.parked: dict[str, Any] = {}  # values waiting to be wrapped in an RRef
        self.closing = False
        # what happened meanwhile that the notebook should hear of (a member answers again):
        # shown before the next remote cell or %rpc_workers (show_notices)
        self.notices: list[str] = []
        self.shm_warned = False  # the group's one warning about a full /dev/shm was given
        self.watcher: threading.Thread | None = None
        # the ipyparallel cluster whose engines are members (rpcnb.integrations.ipyparallel): client,
        # cluster, whether this group started it, engine id by member name
        self.cluster: dict[str, Any] | None = None
        # environment variables this group changed, with the values to put back
        self.restore_env: dict[str, str | None] = {}
        # with --collectives: the futures of cells given up on while still inside a
        # collective; the next cell waits for them and forms the process group again
        self.collectives_pending: list[Any] = []
        # the group's data paths (rpcnb.membership.start makes them as this member starts)
        self.paths: DataPaths | None = None

    @property
    def is_leader(self) -> bool:
        return self.name == self.leader

    @property
    def kind(self) -> str:
        """What this member is (%rpc_workers' kind): "kernel", "process" (a worker rpcnb
        started), "engine", "headless" or "keeper"."""
        return self.runner.kind if self.runner is not None else "kernel"

    @property
    def one_host(self) -> bool:
        """Every member runs on this host (no --allow-remote): shared memory is possible."""
        return bool(self.options.get("one_host", True))

    def add_member(self, member: Member) -> None:
        with self.lock:
            self.members[member.name] = member

    def admitted(self) -> list[tuple[str, int]]:
        """(name, rank) of every admitted member that is alive."""
        with self.lock:
            return [(m.name, m.rank) for m in self.members.values() if m.alive]

    def others(self) -> list[str]:
        """Every other admitted member that is alive and reachable now."""
        with self.lock:
            return [n for n, m in self.members.items() if n != self.name and m.alive
                    and n not in self.dead and n not in self.unreachable]

    def mark_dead(self, name: str, how: str) -> None:
        """``name`` died (or left): record how, and wake every call waiting on it."""
        with self.lock:
            self.dead[name] = how
            m = self.members.get(name)
            if m is not None:
                m.alive, m.how = False, how
            waiting = [c for c in self.calls.values() if c.worker == name]
        for call in waiting:
            call.inbox.put(("__dead__", name, -1, []))

    def mark_unreachable(self, name: str, since: float) -> None:
        """``name``'s host has sent nothing since ``since`` (``time.time()``): wake every
        call waiting on it, and fail the plain torch calls in flight to it; it stays a
        member."""
        with self.lock:
            self.unreachable[name] = since
            waiting = [c for c in self.calls.values() if c.worker == name]
            plain = list(self.in_flight.get(name, ()))
        for call in waiting:
            call.inbox.put(("__dead__", name, -1, []))
        if plain:
            message = self.unreachable_message(name)
            for p in plain:
                p.fail(errors.WorkerUnreachableError(message, name))

    def watch_call(self, name: str, call: Any) -> None:
        """A plain call to ``name`` is in flight (``call.fail(exc)`` ends it early)."""
        with self.lock:
            self.in_flight.setdefault(name, set()).add(call)

    def unwatch_call(self, name: str, call: Any) -> None:
        with self.lock:
            calls = self.in_flight.get(name)
            if calls is not None:
                calls.discard(call)

    def notice(self, line: str) -> None:
        """Say ``line`` in the terminal now, and in the notebook before its next remote cell
        or ``%rpc_workers`` (a watcher thread's output would land in whichever cell ran last)."""
        print(line, file=sys.__stderr__, flush=True)
        with self.lock:
            self.notices = [*self.notices[-19:], line]

    def show_notices(self) -> None:
        """Print what happened meanwhile (``notice``), once, to this thread's stderr."""
        if not self.notices:  # every cell passes here: nothing to do, no lock
            return
        with self.lock:
            said, self.notices = self.notices, []
        for line in said:
            print(line, file=sys.stderr)

    def reachable(self, name: str) -> float | None:
        """``name`` answers again (or never stopped): since when it had been unreachable
        (``time.time()``), None if it was not."""
        with self.lock:
            return self.unreachable.pop(name, None)

    def unreachable_message(self, name: str) -> str:
        """What a call to the unreachable member ``name`` says."""
        with self.lock:
            since = self.unreachable.get(name, time.time())
            m = self.members.get(name)
            host = (m.address or m.host) if m is not None else ""
        return errors.WORKER_UNREACHABLE.format(
            name=name, host=host or "another host", ago=max(0.0, time.time() - since),
            since=time.strftime("%H:%M:%S", time.localtime(since)))

    def revive(self, name: str) -> None:
        """``name`` is back (a fresh process under the same name, ``%rpc_restart``): calls
        to it are sent again once it is admitted."""
        with self.lock:
            self.dead.pop(name, None)
            self.members.pop(name, None)

    def death_message(self, name: str) -> str:
        """What a call to the dead member ``name`` says (with its log's end, if ours)."""
        with self.lock:
            how = self.dead.get(name, "")
            proc = self.procs.get(name)
        if how == "left":
            return errors.WORKER_LEFT.format(name=name)
        msg = errors.WORKER_DIED.format(name=name, how=how or "unknown cause")
        if proc is not None:
            msg += f"\nIts log ends with:\n{proc.log_tail(8)}"
        return msg

    def set_env(self, key: str, value: str) -> None:
        """Set an environment variable for this group only (``restore`` puts it back)."""
        if key not in self.restore_env:
            self.restore_env[key] = os.environ.get(key)
        os.environ[key] = value

    def restore(self) -> None:
        """Put back the environment variables this group changed."""
        for key, value in self.restore_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.restore_env.clear()


_current: Session | None = None
_current_lock = threading.Lock()


def current() -> Session:
    """This process's session (RpcnbError when it is in no group)."""
    s = _current
    if s is None:
        raise RpcnbError(errors.NOT_INITIALIZED)
    return s


def active() -> Session | None:
    """This process's session, or None (compare by identity to tell groups apart)."""
    return _current


def is_initialized() -> bool:
    """Whether this process is in a group now."""
    return _current is not None


def begin(session: Session) -> None:
    """``session`` is this process's from now on (RpcnbError if there is one already)."""
    global _current
    with _current_lock:
        if _current is not None:
            raise RpcnbError(errors.ALREADY_INITIALIZED.format(name=_current.name))
        _current = session


def end(session: Session) -> None:
    """``session`` is over (nothing happens if another one is current)."""
    global _current
    with _current_lock:
        if _current is session:
            _current = None
    session.restore()


def verified(token: Any) -> Session:
    """The session, if ``token`` is the group's; every request from another member goes
    through this."""
    s = _current
    if s is None or not rendezvous.verify(s.token, token):
        raise PermissionError(rendezvous.BAD_TOKEN)
    return s
