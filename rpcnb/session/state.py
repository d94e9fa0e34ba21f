"""This process's membership in a group, as one object: who it is, who the others are,
which of them died or cannot be reached, its calls in flight, the processes it started.

RPC threads, the death watcher and the notebook's thread all read and write it, so every
mutable field is touched under ``Session.lock``. ``current()`` is the session of this
process (one group at a time); ``verified(token)`` is how every request from another
member is let in.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from rpcnb import errors, settings
from rpcnb.errors import RpcnbError
from rpcnb.procs import launch
from rpcnb.session import rendezvous
from rpcnb.session.members import Collectives, Member, Status, WorkerSpec
from rpcnb.session.teardown import Teardown
from rpcnb.wire.options import GroupOptions

ALL = "--all"


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
                 options: GroupOptions, secret: str, *, runner: Any = None,
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
        # how each of them was started: %rpc_restart starts it again
        self.specs: dict[str, WorkerSpec] = {}
        # admitted members (they know the secret), and any name that died or left (a worker
        # may die before it is admitted): each member's Status is here, and only here
        self.members: dict[str, Member] = {}
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
        # with --collectives: the workers' process group, and the futures of cells given up
        # on while still inside a collective (the next cell waits for them, then forms the
        # process group again)
        self.collectives: Collectives | None = None
        # the kept group this process is attached to (a kernel), or keeps (its keeper)
        self.kept_group: str | None = None
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
        return self.options.one_host

    def add_member(self, member: Member, replace: bool = True) -> None:
        """``member`` is admitted (``replace=False``: unless it is known already)."""
        with self.lock:
            if replace or member.name not in self.members:
                self.members[member.name] = member

    def note_facts(self, name: str, facts: dict[str, Any]) -> None:
        """The channel facts member ``name`` reported (``rpcnb.observe.channels``)."""
        with self.lock:
            self.facts[name] = facts

    def facts_of(self, names: Any) -> dict[str, dict[str, Any]]:
        """The channel facts reported by each of ``names`` that reported them."""
        with self.lock:
            return {n: self.facts[n] for n in names if n in self.facts}

    def note(self, name: str, rank: int, **facts: Any) -> Member:
        """Keep what is known of member ``name`` (``facts``: Member fields such as host,
        pid, kind, devices, memory, busy); its record is made, with ``rank``, where there
        is none. Liveness is not a fact: the ``mark_*`` methods change it."""
        with self.lock:
            m = self.members.setdefault(name, Member(name, rank))
            for key, value in facts.items():
                if key in ("status", "how", "since") or not hasattr(m, key):
                    raise AttributeError(f"Member has no fact {key!r}")
                setattr(m, key, value)
            return m

    def records(self) -> list[Member]:
        """Every member's record now (the records themselves: read, not changed)."""
        with self.lock:
            return list(self.members.values())

    def add_worker(self, name: str, proc: launch.LocalWorker, spec: WorkerSpec | None = None
                   ) -> None:
        """A worker process this process started (``spec``: how, when it is new)."""
        with self.lock:
            self.procs[name] = proc
            if spec is not None:
                self.specs[name] = spec

    def worker_spec(self, name: str) -> WorkerSpec | None:
        with self.lock:
            return self.specs.get(name)

    def forget_workers(self, names: Any) -> None:
        """These workers' processes are none of this process's any more (a failed add)."""
        with self.lock:
            for name in names:
                self.procs.pop(name, None)

    def first_shm_warning(self) -> bool:
        """Whether the group's one warning of a full /dev/shm is still to be given (then it
        counts as given)."""
        with self.lock:
            first, self.shm_warned = not self.shm_warned, True
        return first

    def set_cluster(self, cluster: dict[str, Any]) -> None:
        """The ipyparallel cluster whose engines are members (``rpcnb.integrations``)."""
        with self.lock:
            self.cluster = cluster

    def workers_started(self) -> dict[str, launch.LocalWorker]:
        """The worker processes this process started, by name."""
        with self.lock:
            return dict(self.procs)

    def admitted(self) -> list[tuple[str, int]]:
        """(name, rank) of every admitted member that is alive."""
        with self.lock:
            return [(m.name, m.rank) for m in self.members.values() if m.alive]

    def others(self) -> list[str]:
        """Every other admitted member that is alive and reachable now."""
        with self.lock:
            return [n for n, m in self.members.items()
                    if n != self.name and m.status is Status.ALIVE]

    # -- liveness: each member's Status, read without the lock (one dict lookup)
    def is_dead(self, name: str) -> bool:
        """Whether ``name`` died or left."""
        m = self.members.get(name)
        return m is not None and m.status is Status.DEAD

    def is_unreachable(self, name: str) -> bool:
        """Whether ``name``'s host has answered nothing for a while (``mark_unreachable``)."""
        m = self.members.get(name)
        return m is not None and m.status is Status.UNREACHABLE

    def is_admitted(self, name: str) -> bool:
        """Whether ``name`` registered with the leader and has not died or left since."""
        m = self.members.get(name)
        return m is not None and m.status is not Status.DEAD

    def how_gone(self, name: str) -> str | None:
        """How ``name`` died or left (None: it did not)."""
        m = self.members.get(name)
        return m.how if m is not None and m.status is Status.DEAD else None

    def dead(self) -> dict[str, str]:
        """Every member that died or left, with how."""
        with self.lock:
            return {n: m.how for n, m in self.members.items() if m.status is Status.DEAD}

    def unreachable(self) -> dict[str, float]:
        """Every unreachable member, with since when (``time.time()``)."""
        with self.lock:
            return {n: m.since or 0.0 for n, m in self.members.items()
                    if m.status is Status.UNREACHABLE}

    def mark_dead(self, name: str, how: str) -> None:
        """``name`` died (or left): record how, and wake every call waiting on it."""
        with self.lock:
            m = self.members.setdefault(name, Member(name, -1))
            m.status, m.how, m.since = Status.DEAD, how, None
            waiting = [c for c in self.calls.values() if c.worker == name]
        for call in waiting:
            call.gone()

    def mark_unreachable(self, name: str, since: float) -> None:
        """``name``'s host has sent nothing since ``since`` (``time.time()``): wake every
        call waiting on it, and fail the plain torch calls in flight to it; it stays a
        member."""
        with self.lock:
            m = self.members.get(name)
            if m is not None and m.status is not Status.DEAD:
                m.status, m.since = Status.UNREACHABLE, since
            waiting = [c for c in self.calls.values() if c.worker == name]
            plain = list(self.in_flight.get(name, ()))
        for call in waiting:
            call.gone()
        if plain:
            message = self.unreachable_message(name)
            for p in plain:
                p.fail(errors.WorkerUnreachableError(message, name))

    def reachable(self, name: str) -> float | None:
        """``name`` answers again (or never stopped): since when it had been unreachable
        (``time.time()``), None if it was not."""
        with self.lock:
            m = self.members.get(name)
            if m is None or m.status is not Status.UNREACHABLE:
                return None
            since, m.status, m.since = m.since, Status.ALIVE, None
            return since

    def mark_silent(self, name: str, why: str) -> None:
        """``name`` did not answer a question in time (``%rpc_workers``): it shows as not
        answering until it answers (``answered``); a dead or unreachable one stays so."""
        with self.lock:
            m = self.members.get(name)
            if m is not None and m.status in (Status.ALIVE, Status.SILENT):
                m.status, m.how = Status.SILENT, why

    def answered(self, name: str) -> None:
        """``name`` answered a question: a silent member is alive again."""
        with self.lock:
            m = self.members.get(name)
            if m is not None and m.status is Status.SILENT:
                m.status, m.how = Status.ALIVE, ""

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

    def unreachable_message(self, name: str) -> str:
        """What a call to the unreachable member ``name`` says."""
        with self.lock:
            m = self.members.get(name)
            since = (m.since if m is not None else None) or time.time()
            host = (m.address or m.host) if m is not None else ""
        return errors.WORKER_UNREACHABLE.format(
            name=name, host=host or "another host", ago=max(0.0, time.time() - since),
            since=time.strftime("%H:%M:%S", time.localtime(since)))

    def revive(self, name: str) -> None:
        """``name`` is back (a fresh process under the same name, ``%rpc_restart``): calls
        to it are sent again once it is admitted."""
        with self.lock:
            self.members.pop(name, None)

    def death_message(self, name: str) -> str:
        """What a call to the dead member ``name`` says (with its log's end, if ours)."""
        how = self.how_gone(name) or ""
        with self.lock:
            proc = self.procs.get(name)
        if how == "left":
            return errors.WORKER_LEFT.format(name=name)
        msg = errors.WORKER_DIED.format(name=name, how=how or "unknown cause")
        if proc is not None:
            msg += f"\nIts log ends with:\n{proc.log_tail(8)}"
        return msg

    # -- the remote cells this process waits for (rpcnb.cells)
    def add_call(self, call: Any) -> None:
        """Route the output of ``call`` (a ``rpcnb.cells.waiter.Call``) to it from now on."""
        with self.lock:
            self.calls[call.call_id] = call

    def call(self, call_id: str) -> Any:
        """The call ``call_id`` this process waits for, or None (given up on, or ended)."""
        with self.lock:
            return self.calls.get(call_id)

    def forget_calls(self, call_ids: Any) -> None:
        """Output for these calls goes nowhere from now on."""
        with self.lock:
            for cid in call_ids:
                self.calls.pop(cid, None)

    def calls_to(self, worker: str | None = None) -> list[Any]:
        """The calls this process waits for (on ``worker``, or on anyone)."""
        with self.lock:
            return [c for c in self.calls.values() if worker is None or c.worker == worker]

    def next_job_id(self) -> int:
        """The id of the next background cell this process sends (they count up from 1)."""
        with self.lock:
            self.jobs_started += 1
            return self.jobs_started

    def add_job(self, job: Any) -> None:
        """A background cell this process sent (``rpcnb.cells.background``), by its id."""
        with self.lock:
            self.background[job.id] = job

    def jobs(self) -> dict[int, Any]:
        """The background cells this process sent, by id."""
        if not self.background:  # none was ever started (most sessions): no lock to take
            return {}
        with self.lock:
            return dict(self.background)

    def park(self, key: str, value: Any) -> None:
        """Keep ``value`` until ``unpark(key)`` wraps it in an RRef owned here."""
        with self.lock:
            self.parked[key] = value

    def unpark(self, key: str) -> Any:
        with self.lock:
            return self.parked.pop(key)

    def left_in_collectives(self, futures: Any) -> None:
        """Cells given up on inside a collective: the next cell waits for these futures."""
        with self.lock:
            self.collectives_pending.extend(futures)

    def take_collectives_left(self) -> list[Any]:
        """The futures ``left_in_collectives`` kept (taken: none are kept after)."""
        if not self.collectives_pending:  # every cell passes here: nothing to do, no lock
            return []
        with self.lock:
            pending, self.collectives_pending = self.collectives_pending, []
        return pending

    def set_env(self, key: str, value: str) -> None:
        """Set an environment variable for this group only (``restore`` puts it back)."""
        before = settings.replace(key, value)
        self.restore_env.setdefault(key, before)

    def restore(self) -> None:
        """Put back the environment variables this group changed."""
        for key, value in self.restore_env.items():
            settings.replace(key, value)
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
