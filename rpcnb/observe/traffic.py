"""What flows between the members of a group, as the channel monitor and the JupyterLab
panel show it: per ordered pair the predicted transport and channel with the measured
calls, latency and bandwidth; per peer the latency of each call over time; per peer the
probe's latency-versus-size curve.

``Traffic`` keeps what is costly to ask for: the prediction (facts gathered once per
member) and the other members' own call statistics (a ``peer_stats`` request each, at
most as often as the caller refreshes with ``remote=True``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rpcnb import telemetry
from rpcnb.observe import channels, probe
from rpcnb.session import protocol, roster
from rpcnb.session.state import Session

SERIES_POINTS = 240  # latency points kept per peer for a chart
JOINED_MOMENTS_AGO = "joined moments ago: predicted at the next update"


@dataclass
class Picture:
    """The group's traffic at one moment (plain data, ready to send to a front end)."""

    members: list[str]
    # "src->dst": {transport, channel, reason, devices, calls, p50_ms, bytes_per_s, paths,
    # ucx} (paths: the tensors that took rpcnb's own paths, {"rpcnb_shm"|"zero_copy"|
    # "ucx: tcp": {tensors, bytes}}; ucx: the UCX transport of the latest one over UCX)
    matrix: dict[str, dict[str, Any]] = field(default_factory=dict)
    series: dict[str, list[list[float]]] = field(default_factory=dict)  # peer -> [[t, ms]]
    curve: dict[str, list[list[Any]]] = field(default_factory=dict)  # peer -> [[bytes, ms, B/s, path]]


class Traffic:
    """The traffic of ``session``'s group (see the module's docstring)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._remote: dict[str, dict[str, dict[str, Any]]] = {}
        self.remote_at = 0.0  # time.monotonic() of the last peer_stats round
        self._predicted = {f"{a}->{b}": p for (a, b), p in channels.predict_group().items()}

    def _ask_remote(self) -> None:
        s = self.session
        futs = {}
        for name in roster.live_names(s):
            if name != s.name:
                try:
                    futs[name] = protocol.call_async(s.token, name, "peer_stats", timeout=5)
                except Exception:
                    pass
        for name, fut in futs.items():
            try:
                self._remote[name] = fut.wait()
            except Exception:
                self._remote.pop(name, None)
        self.remote_at = time.monotonic()

    def picture(self, remote: bool, since: float = 0.0, points: int = SERIES_POINTS) -> Picture:
        """The traffic now. ``remote``: ask the other members for their own calls first
        (and predict the pairs of members that joined since); ``since``/``points``: the
        latency series' start (epoch seconds) and its length per peer at most."""
        if remote:
            self._ask_remote()
        s = self.session
        members = roster.live_names(s)
        if remote and any(f"{a}->{b}" not in self._predicted
                          for a in members for b in members if a != b):
            self._predicted = {f"{a}->{b}": p for (a, b), p in channels.predict_group().items()}
        mine = telemetry.peer_stats()
        matrix: dict[str, Any] = {}
        for a in members:
            for b in members:
                if a == b:
                    continue
                key = f"{a}->{b}"
                pred = self._predicted.get(key)
                cpu = pred.channels.get("cpu->cpu") if pred else None
                cell: dict[str, Any] = {
                    "transport": pred.transport.name if pred else "?",
                    "channel": cpu.name if cpu else "?",
                    "reason": (f"{pred.transport.reason}; {cpu.reason}" if pred and cpu
                               else JOINED_MOMENTS_AGO),
                    "devices": {pair: c.name for pair, c in pred.channels.items()} if pred else {},
                }
                source = mine if a == s.name else self._remote.get(a, {})
                cell.update(source.get(b) or {"calls": 0, "p50_ms": None, "bytes_per_s": None,
                                             "paths": {}, "ucx": None})
                matrix[key] = cell
        series: dict[str, list[list[float]]] = {}
        curve: dict[str, list[list[Any]]] = {}
        for rec in telemetry.records(since=since):
            if rec["op"] in telemetry.MONITOR_OPS or not rec["peer"] or rec["peer"] == s.name:
                continue
            if rec["op"] == probe.OP:
                if rec["nbytes"]:
                    curve.setdefault(rec["peer"], []).append(
                        [rec["nbytes"], rec["duration"] * 1e3,
                         rec["nbytes"] / rec["duration"] if rec["duration"] > 0 else 0,
                         rec["channel"]])
                continue
            # latency: in transit and in rpcnb, not the time a remote cell's code ran
            series.setdefault(rec["peer"], []).append(
                [rec["start"], max(rec["duration"] - rec.get("ran", 0.0), 0.0) * 1e3])
        for peer, pts in curve.items():
            latest: dict[int, list[Any]] = {}
            for point in pts:  # the last probe of each size wins
                latest[point[0]] = point
            curve[peer] = sorted(latest.values())
        return Picture(members, matrix, {p: pts[-points:] for p, pts in series.items()}, curve)

