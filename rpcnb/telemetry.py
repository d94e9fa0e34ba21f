"""Every call rpcnb makes or serves, recorded: peer, operation, bytes, channel, duration.

A bounded ring buffer per process, cheap enough to sit on every call (one deque append
under a lock), with per-peer summaries (count, p50, p95, bytes/s) and export as plain
records. ``install()`` hooks torch's RPC entry points so plain ``rpc.rpc_sync`` /
``rpc_async`` / ``remote`` calls made in a notebook are recorded too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

CAPACITY = 8192


@dataclass(frozen=True)
class Record:
    peer: str
    op: str
    start: float  # time.time() when the call started
    duration: float  # seconds
    nbytes: int = 0  # tensor bytes sent
    ok: bool = True
    channel: str = ""  # "" when TensorPipe chose (see rpcnb.channels), or "rpcnb_shm"


_lock = threading.Lock()
_records: deque[Record] = deque(maxlen=CAPACITY)
_counts: dict[str, int] = {}
_listeners: list[Any] = []


def record(peer: str, op: str, start: float, duration: float, nbytes: int = 0,
           ok: bool = True, channel: str = "") -> None:
    """Add one record (and tell the listeners)."""
    rec = Record(peer, op, start, duration, nbytes, ok, channel)
    with _lock:
        _records.append(rec)
        _counts[peer] = _counts.get(peer, 0) + 1
    for listener in _listeners:
        listener(rec)


def subscribe(listener: Any) -> None:
    """Call ``listener(record)`` for every new record (keep it fast: it runs inline)."""
    _listeners.append(listener)


def unsubscribe(listener: Any) -> None:
    """Stop calling ``listener``."""
    if listener in _listeners:
        _listeners.remove(listener)


def records(peer: str | None = None, since: float = 0.0) -> list[dict[str, Any]]:
    """Recorded calls, oldest first, as plain dicts."""
    with _lock:
        recs = list(_records)
    return [asdict(r) for r in recs if (peer is None or r.peer == peer) and r.start >= since]


def _quantile(sorted_values: list[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


def summary(peer: str, recent: int = 20) -> dict[str, Any]:
    """Calls to ``peer``: total count; p50/p95 latency (ms) and bytes/s over the records
    kept; ``recent_ms``: the median of the last ``recent`` calls."""
    with _lock:
        count = _counts.get(peer, 0)
        recs = [r for r in _records if r.peer == peer]
    durs = sorted(r.duration for r in recs)
    last = sorted(r.duration for r in recs[-recent:])
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
    with _lock:
        _records.clear()
        _counts.clear()


def now() -> float:
    """Wall-clock time, as records store it."""
    return time.time()


def tensor_bytes(args: Any, kwargs: Any = None) -> int:
    """Bytes of the tensors among call arguments (one level deep: cheap)."""
    import torch

    total = 0
    items = list(args or ()) + list((kwargs or {}).values())
    for item in items:
        if isinstance(item, torch.Tensor):
            total += item.element_size() * item.nelement()
        elif isinstance(item, (list, tuple)):
            total += sum(x.element_size() * x.nelement() for x in item
                         if isinstance(x, torch.Tensor))
    return total


_installed = False


def install() -> None:
    """Record plain torch RPC calls made in this process (idempotent; imports torch)."""
    global _installed
    if _installed:
        return
    import torch.distributed.rpc as rpc
    from torch.distributed.rpc import api

    original_invoke = api._invoke_rpc
    original_remote = api.remote

    def _peer(to: Any) -> str:
        return to if isinstance(to, str) else str(getattr(to, "name", to))

    def _op(func: Any) -> str:
        return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", "call"))

    def _watch(fut: Any, peer: str, op: str, nbytes: int) -> None:
        start, t0 = time.time(), time.perf_counter()

        def done(f: Any) -> None:
            record(peer, op, start, time.perf_counter() - t0, nbytes,
                   ok=not _failed(f))

        fut.add_done_callback(done)

    def invoke(to: Any, func: Any, rpc_type: Any, args: Any = None, kwargs: Any = None,
               rpc_timeout: float = api.UNSET_RPC_TIMEOUT) -> Any:
        peer = _peer(to)
        _current.peer = peer
        try:
            fut = original_invoke(to, func, rpc_type, args, kwargs, rpc_timeout)
        finally:
            _current.peer = None
        _watch(fut, peer, _op(func), tensor_bytes(args, kwargs))
        return fut

    def remote(to: Any, func: Any, args: Any = None, kwargs: Any = None,
               timeout: float = api.UNSET_RPC_TIMEOUT) -> Any:
        peer = _peer(to)
        _current.peer = peer
        try:
            rref = original_remote(to, func, args, kwargs, timeout)
        finally:
            _current.peer = None
        try:
            _watch(rref._get_future(), peer, "remote:" + _op(func), tensor_bytes(args, kwargs))
        except Exception:
            pass
        return rref

    api._invoke_rpc = invoke
    api.remote = remote
    rpc.remote = remote  # the package re-exports api's names
    _installed = True


def _failed(fut: Any) -> bool:
    try:
        fut.wait()
    except Exception:
        return True
    return False


class _Current(threading.local):
    peer: str | None = None


_current = _Current()


def current_peer() -> str:
    """The peer of the RPC this thread is sending right now ('' for a reply or unknown)."""
    return _current.peer or ""
