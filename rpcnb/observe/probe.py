"""Measure each peer: round-trip latency of an empty call, and the time and bandwidth of
sending one tensor, over sizes from 1 KB to 256 MB.

Every measurement goes into telemetry as a record with op ``"probe"`` (``nbytes`` the
size, 0 for the empty call; ``duration`` the median round trip; ``channel`` the path the
tensor took), so the channel monitor and ``telemetry.records()`` keep the results.
The peer answers the requests ``probe_echo`` (nothing) and ``probe_sink`` (a tensor in,
its size back) of ``rpcnb.membership.handlers``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from rpcnb import progress, telemetry, text
from rpcnb.observe import channels
from rpcnb.paths import shm
from rpcnb.session import protocol, roster, state

OP = "probe"
DEFAULT_SIZES = [1024 * 4**i for i in range(10)]  # 1 KB, 4 KB, ... 256 MB
DEFAULT_REPEATS = 3
LATENCY_CALLS = 20

NO_PEERS = "There is no other member to probe: start workers with %rpc_init --workers N."
SELF_PROBE = "{name!r} is this process: probe the other members."
BAD_SIZE = "{text!r} is not a size: write bytes as a number with an optional K, M or G (1K, 256M)."
BAD_REPEATS = "repeats must be a whole number >= 1, not {value!r}."

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30}


def parse_size(text: str) -> int:
    """'256M' -> 268435456; '1K' -> 1024; '4096' -> 4096."""
    raw = text.strip().upper()
    num = raw.rstrip("BKMG")
    unit = raw[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise ValueError(BAD_SIZE.format(text=text)) from None
    if unit not in _UNITS or value <= 0:
        raise ValueError(BAD_SIZE.format(text=text))
    return int(value * _UNITS[unit])


def format_rate(bytes_per_s: float) -> str:
    """Bandwidth in words: '1.62 GB/s', '48.0 MB/s', '312 KB/s'."""
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.2f} GB/s"
    if bytes_per_s >= 1e6:
        return f"{bytes_per_s / 1e6:.1f} MB/s"
    return f"{bytes_per_s / 1e3:.0f} KB/s"


@dataclass
class Point:
    """One size sent to one peer."""

    nbytes: int
    seconds: float  # median round trip: the tensor there, its size back
    channel: str  # "rpcnb_shm", or TensorPipe's channel as predicted

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0


@dataclass
class PeerResult:
    peer: str
    latency_s: float  # median round trip of an empty call
    points: list[Point] = field(default_factory=list)


@dataclass
class ProbeResults:
    """What ``probe`` measured; shows as a table."""

    me: str
    peers: list[PeerResult]

    def to_dict(self) -> dict[str, Any]:
        return {
            "me": self.me,
            "peers": [{
                "peer": p.peer, "latency_ms": p.latency_s * 1e3,
                "points": [{"nbytes": q.nbytes, "ms": q.seconds * 1e3,
                            "bytes_per_s": q.bytes_per_s, "channel": q.channel}
                           for q in p.points],
            } for p in self.peers],
        }

    def table(self) -> str:
        rows = [("peer", "size", "round trip", "bandwidth", "path")]
        for p in self.peers:
            rows.append((p.peer, "empty call", f"{p.latency_s * 1e3:.3f} ms", "", ""))
            for q in p.points:
                rows.append(("", text.size(q.nbytes, decimals=None), f"{q.seconds * 1e3:.3f} ms",
                             format_rate(q.bytes_per_s), q.channel))
        return text.table(rows)

    def __str__(self) -> str:
        return f"probe from {self.me}\n{self.table()}"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


class _Progress:
    """The probe's bar (tqdm.auto: a widget in a notebook, a line on stderr elsewhere)."""

    def __init__(self, total: int, show: bool) -> None:
        self.bar = progress.tqdm(total=total, desc="probe", unit="step") if show else None

    def step(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text[:24], refresh=False)
            self.bar.update(1)

    def close(self, ok: bool) -> None:
        if self.bar is not None:
            self.bar.set_description_str("probe done" if ok else "probe stopped", refresh=False)
            self.bar.close()


def _median_round_trip(call: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe(workers: list[str] | None = None, sizes: list[int] | None = None,
          repeats: int = DEFAULT_REPEATS, *, tensorpipe_only: bool = False,
          progress: bool = True) -> ProbeResults:
    """Measure the round trip of an empty call and of one tensor per size, to each of
    ``workers`` (default: every other member), ``repeats`` times each (the median is
    kept). ``tensorpipe_only`` keeps large tensors off rpcnb's shared-memory path, to
    measure TensorPipe's own channel."""
    import torch

    s = state.current()
    workers = roster.expand(s, workers) if workers else None  # a worker set: worker1-8
    live = roster.live_names(s)
    peers = [n for n in live if n != s.name] if not workers else list(workers)
    for name in peers:
        if name == s.name:
            raise ValueError(SELF_PROBE.format(name=name))
        if name not in live:
            raise ValueError(channels.NOT_IN_GROUP.format(name=name, known=", ".join(live)))
    if not peers:
        raise ValueError(NO_PEERS)
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(BAD_REPEATS.format(value=repeats))
    sizes = sorted(set(sizes or DEFAULT_SIZES))
    try:
        predicted = channels.predict_group([s.name, *peers])
    except Exception:  # the probe still measures; the path is then unnamed
        predicted = {}

    bar = _Progress(len(peers) * (len(sizes) + 1), progress)
    results = ProbeResults(s.name, [])
    ok = False
    try:
        for peer in peers:
            def echo(peer: str = peer) -> None:
                protocol.call(s.token, peer, "probe_echo", timeout=None)

            echo()  # the pipe exists before anything is timed
            start = telemetry.now()
            latency = _median_round_trip(echo, LATENCY_CALLS)
            telemetry.record(peer, OP, start, latency, 0, channel="")
            result = PeerResult(peer, latency)
            results.peers.append(result)
            bar.step(f"{peer} latency")
            pipe = predicted.get((s.name, peer))
            tp_channel = pipe.channels["cpu->cpu"].name if pipe else "tensorpipe"
            for nbytes in sizes:
                tensor = torch.ones(nbytes, dtype=torch.uint8)  # pages touched: no faults timed

                def send(tensor: Any = tensor, peer: str = peer) -> None:
                    if tensorpipe_only:
                        with shm.suppressed():
                            protocol.call(s.token, peer, "probe_sink", tensor, timeout=None,
                                          nbytes=tensor.nbytes)
                    else:
                        protocol.call(s.token, peer, "probe_sink", tensor, timeout=None,
                                      nbytes=tensor.nbytes)

                path = tp_channel if tensorpipe_only or not shm.wants(tensor) else "rpcnb_shm"
                start = telemetry.now()
                seconds = _median_round_trip(send, repeats)
                telemetry.record(peer, OP, start, seconds, nbytes, channel=path)
                result.points.append(Point(nbytes, seconds, path))
                del tensor
                bar.step(f"{peer} {text.size(nbytes, decimals=None)}")
        ok = True
    finally:
        bar.close(ok)
    return results


def probe_records(peer: str | None = None) -> list[dict[str, Any]]:
    """The probe's measurements kept in telemetry (op ``"probe"``), oldest first."""
    return [r for r in telemetry.records(peer) if r["op"] == OP]
