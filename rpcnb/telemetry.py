"""Every call rpcnb makes, recorded: peer, operation, bytes, duration.

A bounded ring buffer per process, cheap enough to sit on every call, with per-peer
summaries for ``%rpc_workers``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any

CAPACITY = 4096


@dataclass(frozen=True)
class Record:
    peer: str
    op: str
    start: float  # time.time() when the call started
    duration: float  # seconds
    nbytes: int = 0
    ok: bool = True


_lock = threading.Lock()
_records: deque[Record] = deque(maxlen=CAPACITY)
_counts: dict[str, int] = {}


def record(peer: str, op: str, start: float, duration: float, nbytes: int = 0,
           ok: bool = True) -> None:
    rec = Record(peer, op, start, duration, nbytes, ok)
    with _lock:
        _records.append(rec)
        _counts[peer] = _counts.get(peer, 0) + 1


def records(peer: str | None = None) -> list[dict[str, Any]]:
    """Recorded calls, oldest first, as plain dicts."""
    with _lock:
        recs = list(_records)
    return [asdict(r) for r in recs if peer is None or r.peer == peer]


def summary(peer: str, recent: int = 20) -> dict[str, Any]:
    """Calls to ``peer`` so far, and the median latency of the most recent ones (ms)."""
    with _lock:
        count = _counts.get(peer, 0)
        durs = [r.duration for r in _records if r.peer == peer][-recent:]
    return {"calls": count, "recent_ms": median(durs) * 1e3 if durs else None}


def clear() -> None:
    with _lock:
        _records.clear()
        _counts.clear()


def now() -> float:
    return time.time()
