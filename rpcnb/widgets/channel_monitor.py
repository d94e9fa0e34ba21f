"""The channel monitor: which path each pair of members uses and how fast it is.

A member-by-member matrix (predicted transport and channel, measured latency and
bandwidth), a latency-over-time chart fed by telemetry, and the probe's latency-versus-
size curve. It updates while calls happen: telemetry's listener only sets a flag (it runs
inline on RPC threads), and a daemon thread pushes a new snapshot at most every
``interval`` seconds. Other members' numbers come from their own telemetry, asked every
``remote_interval`` seconds. The thread stops, and the widget says so, when the group is
shut down or the widget is closed.
"""

from __future__ import annotations

import pathlib
import threading
import time
from typing import Any

import anywidget
import traitlets

from rpcnb import telemetry

SERIES_POINTS = 240  # latency points kept per peer for the chart
STOPPED_SHUTDOWN = "stopped: the group was shut down (%rpc_channels opens a new monitor)"
STOPPED_CLOSED = "stopped: the monitor was closed"


class ChannelMonitor(anywidget.AnyWidget):
    """``ChannelMonitor()`` in a notebook that is a member of a group; ``%rpc_channels``."""

    _esm = pathlib.Path(__file__).parent / "channel_monitor.js"

    me = traitlets.Unicode("").tag(sync=True)
    members = traitlets.List(traitlets.Unicode()).tag(sync=True)
    # "src->dst": {transport, channel, reason, calls, p50_ms, bytes_per_s, paths}
    # (paths: tensors that took rpcnb's own paths, {"rpcnb_shm"|"zero_copy": {tensors, bytes}})
    matrix = traitlets.Dict().tag(sync=True)
    series = traitlets.Dict().tag(sync=True)  # peer -> [[t (s, epoch), ms], ...]
    curve = traitlets.Dict().tag(sync=True)  # peer -> [[nbytes, ms, bytes/s, path], ...]
    status = traitlets.Unicode("live").tag(sync=True)
    updated = traitlets.Float(0.0).tag(sync=True)
    updates = traitlets.Int(0).tag(sync=True)

    def __init__(self, interval: float = 0.5, remote_interval: float = 3.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from rpcnb import channels, roster, state

        s = state.current()
        self._session = s  # the group this monitor shows; a later group is not its own
        self._interval = interval
        self._remote_interval = remote_interval
        self._remote: dict[str, dict[str, dict[str, Any]]] = {}
        self._remote_at = 0.0
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self.me = s.name
        predicted = channels.predict_group()
        self.members = roster.live_names(s)
        self._predicted = {f"{a}->{b}": p for (a, b), p in predicted.items()}
        self._refresh(remote=True)
        telemetry.subscribe(self._on_record)
        self._thread = threading.Thread(target=self._loop, name="rpcnb-channel-monitor",
                                        daemon=True)
        self._thread.start()

    # -- updating ---------------------------------------------------------------------------

    def _on_record(self, rec: Any) -> None:
        self._dirty.set()  # inline on an RPC thread: nothing more

    def _loop(self) -> None:
        from rpcnb import state

        while not self._stop.is_set():
            self._stop.wait(self._interval)
            if self._stop.is_set():
                break
            if state.active() is not self._session:
                self._finish(STOPPED_SHUTDOWN)
                return
            due = time.monotonic() - self._remote_at > self._remote_interval
            if self._dirty.is_set() or due:
                self._dirty.clear()
                try:
                    self._refresh(remote=due)
                except Exception:  # the group went away between the check and the calls
                    if state.active() is not self._session:
                        self._finish(STOPPED_SHUTDOWN)
                        return

    def _finish(self, why: str) -> None:
        telemetry.unsubscribe(self._on_record)
        self._stop.set()
        self.status = why

    def __repr__(self) -> str:
        return (f"<ChannelMonitor of {self.me}'s group: {len(self.members)} members, "
                f"{self.status}; %rpc_channels --text prints the prediction>")

    def stop(self) -> None:
        """Stop updating (the widget stays, with its last numbers)."""
        self._finish(STOPPED_CLOSED)

    def close(self) -> None:
        self.stop()
        super().close()

    def _ask_remote(self) -> None:
        from rpcnb import protocol, roster, state

        s = state.current()
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
        self._remote_at = time.monotonic()

    def _refresh(self, remote: bool) -> None:
        from rpcnb import probe, roster, state

        if remote:
            self._ask_remote()
        s = state.current()
        members = roster.live_names(s)
        if remote and any(f"{a}->{b}" not in self._predicted
                          for a in members for b in members if a != b):
            from rpcnb import channels  # a member joined: ask it for its facts too

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
                               else "joined moments ago: predicted at the next update"),
                    "devices": {pair: c.name for pair, c in pred.channels.items()} if pred else {},
                }
                source = mine if a == s.name else self._remote.get(a, {})
                cell.update(source.get(b) or {"calls": 0, "p50_ms": None, "bytes_per_s": None,
                                             "paths": {}})
                matrix[key] = cell
        series: dict[str, list[list[float]]] = {}
        curve: dict[str, list[list[Any]]] = {}
        for rec in telemetry.records():
            if rec["op"] in telemetry.MONITOR_OPS or not rec["peer"] or rec["peer"] == s.name:
                continue
            if rec["op"] == probe.OP:
                if rec["nbytes"]:
                    curve.setdefault(rec["peer"], []).append(
                        [rec["nbytes"], rec["duration"] * 1e3,
                         rec["nbytes"] / rec["duration"] if rec["duration"] > 0 else 0,
                         rec["channel"]])
                continue
            series.setdefault(rec["peer"], []).append([rec["start"], rec["duration"] * 1e3])
        for peer, points in curve.items():
            latest: dict[int, list[Any]] = {}
            for point in points:  # the last probe of each size wins
                latest[point[0]] = point
            curve[peer] = sorted(latest.values())
        with self.hold_sync():
            self.members = members
            self.matrix = matrix
            self.series = {p: pts[-SERIES_POINTS:] for p, pts in series.items()}
            self.curve = curve
            self.updated = time.time()
            self.updates = self.updates + 1
