"""What this process knows of the group's members, as plain records: each member's
``Member`` (with its liveness, one ``Status``), the ``Group`` a view shows, how the leader
started a worker (``WorkerSpec``) and the workers' process group (``Collectives``). The
``Session`` (``rpcnb.session.state``) holds them and changes them under its lock.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rpcnb import text


class Status(enum.Enum):
    """Where a member stands, as this process knows it: one value per member, on its record
    in ``Session.members``, changed only by the Session's methods (``mark_dead``,
    ``mark_unreachable``, ``reachable``, ``mark_silent``, ``answered``)."""

    ALIVE = "alive"
    SILENT = "not answering"  # did not answer %rpc_workers in time; its next answer clears it
    UNREACHABLE = "unreachable"  # its host sends nothing: calls fail fast, it stays a member
    DEAD = "dead"  # died, or left ("left"): its name is not given out again


@dataclass
class Member:
    """What rpcnb knows about one member of the group."""

    name: str
    rank: int  # -1: a worker that died before it was admitted
    host: str = ""
    pid: int | None = None
    kind: str = "process"  # "process" (started by rpcnb), "kernel", "engine" or "headless"
    devices: list[str] = field(default_factory=list)
    gpus: str = ""  # its CUDA_VISIBLE_DEVICES, when rpcnb gave it some (--gpus)
    status: Status = Status.ALIVE
    how: str = ""  # how it died or left, or why it does not answer
    since: float | None = None  # while unreachable: since when (time.time())
    calls: int = 0
    recent_ms: float | None = None
    memory: dict[str, Any] = field(default_factory=dict)  # rss, shm (bytes), gpu (a list)
    address: str = ""  # where its TensorPipe listens: "ADDR (IFACE)"
    # the cell it runs now (rpcnb.membership.start.running_now: cell, first, since, seconds,
    # file, line, text), or None when idle or not known
    busy: dict[str, Any] | None = None

    @property
    def alive(self) -> bool:
        """Neither dead nor silent (an unreachable member is alive: it may answer again)."""
        return self.status is Status.ALIVE or self.status is Status.UNREACHABLE

    @property
    def unreachable(self) -> str:
        """``since 14:02:11 (12 s)`` while its host answers nothing, else ""."""
        if self.status is not Status.UNREACHABLE or self.since is None:
            return ""
        return (f"since {time.strftime('%H:%M:%S', time.localtime(self.since))} "
                f"({max(0.0, time.time() - self.since):.0f} s)")


@dataclass(frozen=True)
class WorkerSpec:
    """How the leader started a worker process, so ``%rpc_restart`` starts it the same way."""

    options: Any  # its rpcnb.wire.options.GroupOptions (its own device map in them)
    env: dict[str, str]  # what its environment adds to the kernel's (CUDA_VISIBLE_DEVICES...)


@dataclass
class Collectives:
    """The workers' ``torch.distributed`` process group (``--collectives``), as the leader
    formed it last (``rpcnb.membership.collectives``)."""

    backend: str  # "gloo" or "nccl"
    ranks: dict[str, int]  # worker -> its rank
    timeout: float  # seconds a collective waits for every rank
    formed: int  # how often it was formed in this group: each forming meets afresh
    reform: Callable[[], str]  # forms it again; what to say (after a collective timed out)


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
