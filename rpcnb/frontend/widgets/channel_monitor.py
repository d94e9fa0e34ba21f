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

import threading
import time
from typing import Any

import anywidget
import traitlets

from rpcnb import telemetry
from rpcnb.frontend.widgets.dom import esm

STOPPED_SHUTDOWN = "stopped: the group was shut down (%rpc_channels opens a new monitor)"
STOPPED_CLOSED = "stopped: the monitor was closed"


class ChannelMonitor(anywidget.AnyWidget):
    """``ChannelMonitor()`` in a notebook that is a member of a group; ``%rpc_channels``."""

    _esm = esm("channel_monitor.js")

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
        from rpcnb.observe.traffic import Traffic
        from rpcnb.session import state

        s = state.current()
        self._session = s  # the group this monitor shows; a later group is not its own
        self._interval = interval
        self._remote_interval = remote_interval
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self.me = s.name
        self._traffic = Traffic(s)  # the computation, shared with the JupyterLab panel
        self._refresh(remote=True)
        telemetry.subscribe(self._on_record)
        self._thread = threading.Thread(target=self._loop, name="rpcnb-channel-monitor",
                                        daemon=True)
        self._thread.start()

    # -- updating ---------------------------------------------------------------------------

    def _on_record(self, rec: Any) -> None:
        self._dirty.set()  # inline on an RPC thread: nothing more

    def _loop(self) -> None:
        from rpcnb.session import state

        while not self._stop.is_set():
            self._stop.wait(self._interval)
            if self._stop.is_set():
                break
            if state.active() is not self._session:
                self._finish(STOPPED_SHUTDOWN)
                return
            due = time.monotonic() - self._traffic.remote_at > self._remote_interval
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

    def _refresh(self, remote: bool) -> None:
        pic = self._traffic.picture(remote)
        with self.hold_sync():
            self.members = pic.members
            self.matrix = pic.matrix
            self.series = pic.series
            self.curve = pic.curve
            self.updated = time.time()
            self.updates = self.updates + 1
