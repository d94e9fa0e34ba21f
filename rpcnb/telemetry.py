"""Every call rpcnb makes or serves, recorded: peer, operation, bytes, channel, duration.

A bounded ring buffer per process (``CALLS``), cheap enough to sit on every call (one
deque append: while no listener is subscribed, of the record's fields, made a Record when
read; under a lock otherwise), with per-peer summaries (count, p50, p95, bytes/s) and
export as plain records. ``rpcnb.paths.serialize.install()`` hooks torch's RPC entry
points so that plain ``rpc.rpc_sync`` / ``rpc_async`` / ``remote`` calls made in a
notebook are recorded too: every call is counted, an ``rpc_sync`` call is also timed
(where it waits), and an ``rpc_async`` or ``remote`` call is timed only while
``timing()`` says so (timing one costs a callback on TensorPipe's thread,
docs/benchmarks.md).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rpcnb import settings

CAPACITY = 8192


@dataclass(slots=True)
class Record:
    """One call. Not frozen: a frozen dataclass's __init__ costs microseconds per call;
    records are never changed once made."""

    peer: str
    op: str
    start: float  # time.time() when the call started
    duration: float  # seconds
    nbytes: int = 0  # tensor bytes sent
    ok: bool = True
    channel: str = ""  # "" when TensorPipe chose (see rpcnb.observe.channels), "rpcnb_shm", "zero_copy",
    # "ucx: tcp"
    ran: float = 0.0  # seconds of ``duration`` that user code ran on the peer (a remote
    # cell's body); the rest is the call's latency: in transit, and rpcnb's own work

    @property
    def latency(self) -> float:
        """The call's time without the time its user code ran: transit and rpcnb."""
        return max(self.duration - self.ran, 0.0)


LATER = 256  # records that wait at most: making them Records takes well under a millisecond
LOOK_S = 10.0  # seconds a member times its calls after a monitor last asked for them
Listener = Callable[[Record], Any]


@dataclass(slots=True)
class CallLog:
    """This process's calls: the newest ``CAPACITY`` records, the count of every call per
    peer, and who listens. One per process (``CALLS``), for its life; a new group clears
    it (``clear``). While no one listens, a call's fields wait in ``later`` (a deque's
    append needs no lock) and become Records when records are read."""

    # held to change the fields below but ``later``; the caller's path takes it only while
    # someone listens, or once every ``LATER`` records to settle them
    lock: threading.Lock = field(default_factory=threading.Lock)
    records: deque[Record] = field(default_factory=lambda: deque(maxlen=CAPACITY))
    counts: dict[str, int] = field(default_factory=dict)  # peer -> calls, timed or not
    listeners: list[Listener] = field(default_factory=list)  # told of each new record
    # the fields of calls recorded while no one listened, oldest first, not yet Records
    later: deque[tuple[Any, ...]] = field(default_factory=deque)
    # calls are timed until then (time.monotonic()): a monitor asked for them (``looked_at``)
    looked_until: float = 0.0


CALLS = CallLog()


def record(peer: str, op: str, start: float, duration: float, nbytes: int = 0,
           ok: bool = True, channel: str = "", ran: float = 0.0) -> None:
    """Add one record (and tell the listeners); ``ran``: the part of ``duration`` that user
    code ran on the peer, which latency figures leave out."""
    if not CALLS.listeners:
        # no one listens: its fields wait, and become a Record when records are read (a
        # deque's append needs no lock; this is the last thing a remote cell's caller does)
        later = CALLS.later
        later.append((peer, op, start, duration, nbytes, ok, channel, ran))
        if len(later) >= LATER:  # a few hundred at a time: no long pause on any one call
            with CALLS.lock:
                _settle(CALLS)
        return
    log = CALLS
    rec = Record(peer, op, start, duration, nbytes, ok, channel, ran)
    with log.lock:
        _settle(log)
        log.records.append(rec)
        log.counts[peer] = log.counts.get(peer, 0) + 1
        listeners = tuple(log.listeners)  # a snapshot: others may (un)subscribe meanwhile
    for listener in listeners:
        listener(rec)


def _settle(log: CallLog) -> None:
    """Make the records that waited (``record``) Records, in order (under ``log.lock``)."""
    later, records, counts = log.later, log.records, log.counts
    while later:
        try:
            fields = later.popleft()
        except IndexError:  # another thread settled it meanwhile
            return
        records.append(Record(*fields))
        counts[fields[0]] = counts.get(fields[0], 0) + 1


def count(peer: str) -> None:
    """Count a call to ``peer`` that is not timed (``timing()`` is off)."""
    with CALLS.lock:
        CALLS.counts[peer] = CALLS.counts.get(peer, 0) + 1


TIMING_ENV = "RPCNB_CALL_TIMES"


def looked_at() -> None:
    """Another member's channel monitor or panel asked for this process's calls (it asks
    every few seconds while it is open): time them for ``LOOK_S`` seconds more."""
    CALLS.looked_until = time.monotonic() + LOOK_S


def timing() -> bool:
    """Whether to time every plain call (``rpc_sync``, ``rpc_async``, ``remote``): while
    someone looks (a channel monitor or the JupyterLab panel subscribed here, or asking
    this member for its calls), or ``RPCNB_CALL_TIMES=1``. Otherwise calls are counted."""
    return bool(CALLS.listeners) or CALLS.looked_until > time.monotonic() or _TIMING.read()


@dataclass(frozen=True, slots=True)
class _EveryCallFlag:
    """A yes-or-no setting read on every call, from os.environ's own dict (CPython's
    _Environ keeps the encoded items in it, and setting or deleting a variable through
    os.environ updates it): without os.environ.get's encoding, about a microsecond.
    Read as ``rpcnb.settings`` reads it where there is no such dict, or for a value other
    than 1, 0 or nothing (an error names a bad one)."""

    name: str
    data: Any  # os.environ's own dict; None where it has none
    key: Any = None
    off: frozenset[Any] = frozenset()
    on: Any = None

    @classmethod
    def of(cls, name: str) -> _EveryCallFlag:
        data = getattr(os.environ, "_data", None)
        if data is None:
            return cls(name, None)
        encode = os.environ.encodevalue  # type: ignore[attr-defined]
        return cls(name, data, os.environ.encodekey(name),  # type: ignore[attr-defined]
                   frozenset(encode(v) for v in ("", "0")), encode("1"))

    def read(self) -> bool:
        """Whether the variable says yes now."""
        if self.data is None:
            return settings.flag(self.name)
        value = self.data.get(self.key)
        if value is None or value in self.off:
            return False
        return value == self.on or settings.flag(self.name)


_TIMING = _EveryCallFlag.of(TIMING_ENV)


def subscribe(listener: Listener) -> None:
    """Call ``listener(record)`` for every new record (keep it fast: it runs inline)."""
    log = CALLS
    with log.lock:
        log.listeners.append(listener)


def unsubscribe(listener: Listener) -> None:
    """Stop calling ``listener``."""
    log = CALLS
    with log.lock:
        if listener in log.listeners:
            log.listeners.remove(listener)


def records(peer: str | None = None, since: float = 0.0) -> list[dict[str, Any]]:
    """Recorded calls, oldest first, as plain dicts."""
    log = CALLS
    with log.lock:
        _settle(log)
        recs = list(log.records)
    return [asdict(r) for r in recs if (peer is None or r.peer == peer) and r.start >= since]


def _quantile(sorted_values: list[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


def summary(peer: str, recent: int = 20) -> dict[str, Any]:
    """Calls to ``peer``: total count; p50/p95 latency (ms: the time in transit and in
    rpcnb, without the time user code ran there) and bytes/s over the records kept;
    ``recent_ms``: the median latency of the last ``recent`` calls."""
    log = CALLS
    with log.lock:
        _settle(log)
        count = log.counts.get(peer, 0)
        recs = [r for r in log.records if r.peer == peer]
    durs = sorted(r.latency for r in recs)
    last = sorted(r.latency for r in recs[-recent:])
    moved = sum(r.nbytes for r in recs)
    busy = sum(r.duration for r in recs if r.nbytes)
    return {
        "calls": count,
        "p50_ms": _quantile(durs, 0.5) * 1e3 if durs else None,
        "p95_ms": _quantile(durs, 0.95) * 1e3 if durs else None,
        "bytes": moved,
        "bytes_per_s": moved / busy if busy > 0 else None,
        "recent_ms": _quantile(last, 0.5) * 1e3 if last else None,
    }


def clear() -> None:
    """Forget every record (a new group starts)."""
    log = CALLS
    with log.lock:
        log.later.clear()
        log.records.clear()
        log.counts.clear()


def now() -> float:
    """Wall-clock time, as records store it."""
    return time.time()


def tensor_bytes(args: Any, kwargs: Any = None) -> int:
    """Bytes of the tensors and DLPack arrays (NumPy, CuPy, ...) among call arguments
    (one level deep: cheap)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    tensor = torch.Tensor
    total = 0
    for group in (args or (), (kwargs or {}).values()):
        for item in group:
            if isinstance(item, (list, tuple)):
                total += sum(_nbytes(x, tensor) for x in item)
            else:
                total += _nbytes(item, tensor)
    return total


def _nbytes(item: Any, tensor: Any) -> int:
    if isinstance(item, tensor):
        return int(item.nbytes)
    if hasattr(type(item), "__dlpack__"):
        n = getattr(item, "nbytes", 0)
        return n if isinstance(n, int) else 0
    return 0


def watch(fut: Any, peer: str, op: str, nbytes: int = 0) -> None:
    """Record the call behind ``fut`` (a torch Future) when it completes."""
    start, t0 = time.time(), time.perf_counter()

    def done(f: Any) -> None:
        record(peer, op, start, time.perf_counter() - t0, nbytes, ok=not _failed(f))

    fut.add_done_callback(done)


def _failed(fut: Any) -> bool:
    try:
        fut.wait()
    except Exception:
        return True
    return False


class Sending(threading.local):
    """What this thread is sending now: set around each call by ``rpcnb.paths.calls`` (plain
    attributes with class defaults: it sits on every call)."""

    peer: str | None = None  # the call's destination; None outside a call (a reply)
    handed: list[int] | None = None  # storages handed over by handle (rpcnb.paths.zerocopy)


SENDING = Sending()


def current_peer() -> str:
    """The peer of the RPC this thread is sending right now ('' for a reply or unknown)."""
    return SENDING.peer or ""


# rpcnb's own bookkeeping calls, left out of the traffic the channel monitor shows
MONITOR_OPS = ("peer_stats", "facts", "ucx_pull")


def traffic_stats(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Calls, p50 latency and bandwidth of ``recs`` (plain records), without the
    monitor's own calls; ``paths``: the tensors that took one of rpcnb's own paths
    (``rpcnb_shm``, ``zero_copy``), as ``{path: {"tensors": n, "bytes": b}}``."""
    calls = [r for r in recs if r["op"] not in MONITOR_OPS]
    if not calls:
        return {"calls": 0, "p50_ms": None, "bytes_per_s": None, "paths": {}, "ucx": None}
    paths: dict[str, dict[str, int]] = {}
    for r in calls:
        if r["channel"]:
            path = paths.setdefault(r["channel"], {"tensors": 0, "bytes": 0})
            path["tensors"] += 1
            path["bytes"] += r["nbytes"]
    moved = [r for r in calls if r["nbytes"] and r["duration"] > 0]
    busy = sum(r["duration"] for r in moved)
    ucx = [r["channel"] for r in calls if r["channel"].startswith("ucx: ")]
    return {
        "calls": len(calls),
        "p50_ms": statistics.median(r["duration"] for r in calls) * 1e3,
        "bytes_per_s": sum(r["nbytes"] for r in moved) / busy if busy > 0 else None,
        # the UCX transport of the latest tensor sent over UCX ("ucx: tcp"), if any
        "ucx": ucx[-1] if ucx else None,
        "paths": paths,
    }


def peer_stats() -> dict[str, dict[str, Any]]:
    """This process's calls to each peer, summarised (what other members' channel
    monitors ask for)."""
    by_peer: dict[str, list[dict[str, Any]]] = {}
    for rec in records():
        if rec["peer"]:
            by_peer.setdefault(rec["peer"], []).append(rec)
    return {peer: traffic_stats(recs) for peer, recs in by_peer.items()}
