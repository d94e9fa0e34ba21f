"""The kernel's side of rpcnb's JupyterLab panel (the "RPC" side panel and status item).

``%load_ext rpcnb`` calls ``register``: the comm target ``rpcnb.panel``, a hook after each
cell, and a hello to the front ends (a comm opened and closed at once, so a panel that
follows this kernel connects now rather than at its next look). A front end opens a comm
to the target; while one is open, a thread of this kernel pushes snapshots of the group
and of the user's kept groups (at most one a second, and only when something changed)
and two more run the panel's actions (``panel_actions.ACTIONS``), one at a time each.
With no panel open nothing runs; nothing here imports torch before a group exists.
"""

from __future__ import annotations

import contextlib
import functools
import json
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from rpcnb import telemetry
from rpcnb.frontend import panel_actions, rrefs
from rpcnb.frontend.held import Held, find_rrefs
from rpcnb.session import state
from rpcnb.session.members import Status
from rpcnb.waiting import Deadline

TARGET = "rpcnb.panel"
# The hello is a message on a comm id that no one opened: a panel listens for it, and every
# other front end drops it without a word (a comm *opened* to a target nobody handles makes
# nbclient and papermill warn "No handler found for comm target").
HELLO_ID = "rpcnb.panel.hello"
PROTOCOL = 1  # the messages' shape; the front end says so when it does not know it
PERIOD = 1.0  # seconds between two snapshots, at least
REFRESH_EVERY = 10.0  # seconds between asking each member about itself (memory, answering)
BUSY_EVERY = 2.0  # seconds between asking the others which cell they run, and where
REMOTE_EVERY = 5.0  # seconds between asking the others for their calls (the channel matrix)
SERIES_SECONDS = 300.0  # the latency charts' span
SERIES_POINTS = 120  # points per peer at most
DESCRIBE_RETRY = 30.0  # seconds before an RRef that could not be described is asked again

NO_GROUP = "No group in this kernel: start one below, or run %rpc_init --workers 2."
# Actions that change this kernel's namespace or the group's size wait until no cell runs
# (the kernel's main thread owns both then); the others (interrupt, restart, probe, join)
# run at once, also while a cell runs: that is when one needs them.
WAIT_FOR_IDLE = frozenset({"start", "shutdown", "fetch", "free", "add", "open", "attach", "end"})


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# -- snapshots ----------------------------------------------------------------------------


def member_rows(group: Any, running: set[str] | frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """``%rpc_workers``'s rows as plain data; ``running``: the workers running one of
    this kernel's remote cells (the panel's interrupt button)."""
    rows = []
    for m in group.members:
        kind = m.kind
        if kind == "kernel" and m.name != group.leader:
            kind = "joined kernel"
        rows.append({
            "name": m.name, "rank": m.rank, "host": m.host, "pid": m.pid, "kind": kind,
            "devices": list(m.devices), "gpus": m.gpus, "alive": m.alive, "how": m.how,
            "calls": m.calls, "recent_ms": m.recent_ms, "memory": dict(m.memory),
            "me": m.name == group.me, "running": m.name in running,
            # the cell it runs and where (the front end counts the seconds from "since")
            "busy": {k: v for k, v in m.busy.items() if k != "seconds"}
            if m.busy and m.status is Status.ALIVE else None,
        })
    return rows


class Publisher:
    """This kernel's panel connections, the thread that feeds them and the one that runs
    their actions."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.lock = threading.Lock()
        self.links: dict[str, Link] = {}
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.actions: dict[str, queue.Queue[Asked]] = {"wait": queue.Queue(),
                                                       "now": queue.Queue()}
        self.actors: dict[str, threading.Thread] = {}
        self.sent = 0  # snapshots sent, for tests
        self.idle = threading.Event()  # no cell runs in this kernel (IPython's events)
        self.idle.set()
        # per group (compared by identity): what is costly to learn again
        self._session: Any = None
        self._traffic: Any = None
        self._traffic_data: dict[str, Any] | None = None
        self._dirty = True  # telemetry recorded a call since the matrix was computed
        self._refreshed = 0.0
        self._busy_at = 0.0
        self._described: dict[str, tuple[float, dict[str, Any]]] = {}
        self._seen: dict[str, float] = {}  # RRef key -> when this kernel first held it

    # -- connections ------------------------------------------------------------------------

    def open(self, comm: Any, msg: dict[str, Any]) -> None:
        """A front end opened a comm to ``rpcnb.panel``."""
        data = (msg.get("content") or {}).get("data") or {}
        link = Link(comm, str(data.get("detail", "full")))
        comm.on_msg(lambda m: self.receive(link, m))
        comm.on_close(lambda m: self.close(link))
        with self.lock:
            self.links[comm.comm_id] = link
            if self.thread is None or not self.thread.is_alive():
                telemetry.subscribe(self._on_record)
                self.thread = threading.Thread(target=self._loop, name="rpcnb-panel", daemon=True)
                self.thread.start()
        self.wake.set()

    def close(self, link: Link) -> None:
        with self.lock:
            self.links.pop(link.comm.comm_id, None)
        self.wake.set()

    def receive(self, link: Link, msg: dict[str, Any]) -> None:
        """A message from the panel (on whatever thread the kernel handles comms on)."""
        data = (msg.get("content") or {}).get("data") or {}
        if data.get("type") == "watch":
            link.detail = str(data.get("detail", "full"))
            link.last = ""  # send the new level's picture at once
            self.wake.set()
        elif data.get("type") == "action":
            # two lines of actions, each one at a time: those that wait for the running
            # cell, and those that must not wait behind them (interrupt, restart, ...)
            kind = "wait" if str(data.get("action")) in WAIT_FOR_IDLE else "now"
            with self.lock:
                self.actions[kind].put(Asked(link, data))
                actor = self.actors.get(kind)
                if actor is None or not actor.is_alive():
                    actor = threading.Thread(target=self._act, args=(kind,), daemon=True,
                                             name=f"rpcnb-panel-actions-{kind}")
                    self.actors[kind] = actor
                    actor.start()

    def before_cell(self, info: Any = None) -> None:
        """A cell starts (IPython's pre_run_cell): actions that need the main thread wait."""
        self.idle.clear()
        if self.links:
            self.wake.set()

    def after_cell(self, result: Any = None) -> None:
        """After each cell (IPython's post_run_cell), while a panel is open: note new
        RRefs (their age counts from here), refresh the panel. Without a panel, nothing."""
        self.idle.set()
        if not self.links:
            return
        if state.active() is not None:
            self._note(find_rrefs(self.shell.user_ns))
        self.wake.set()

    def _on_record(self, rec: Any) -> None:
        self._dirty = True  # inline on an RPC thread: nothing more

    # -- the pushing thread -----------------------------------------------------------------

    def _loop(self) -> None:
        # woken by a change (an Event) or after PERIOD; a snapshot is made no sooner than
        # PERIOD after the last one (``spaced``)
        spaced = Deadline.after(0)
        while True:
            self.wake.wait(PERIOD)
            self.wake.clear()
            spaced.nap(PERIOD)
            with self.lock:
                links = [ln for ln in self.links.values() if ln.detail != "off"]
                if not self.links:
                    telemetry.unsubscribe(self._on_record)
                    self.thread = None
                    return
            if not links:
                continue
            full = any(ln.detail == "full" for ln in links)
            try:
                snap = self.snapshot(full)
            except Exception:  # the group changes under us (starting, leaving): next time
                continue
            spaced = Deadline.after(PERIOD)
            for link in links:
                body = snap if link.detail == "full" else _summary(snap)
                text = json.dumps({k: v for k, v in body.items() if k != "time"},
                                  sort_keys=True, default=str)
                if text == link.last:
                    continue
                try:
                    link.comm.send({"type": "snapshot", "snapshot": body})
                    link.last = text
                    self.sent += 1
                except Exception:
                    self.close(link)

    def snapshot(self, full: bool = True) -> dict[str, Any]:
        """The group now, as the panel shows it (see docs/panel.md for the fields)."""
        snap: dict[str, Any] = {"protocol": PROTOCOL, "time": time.time(), "group": None,
                                "members": [], "message": NO_GROUP,
                                "busy": not self.idle.is_set(),
                                "waits": sorted(WAIT_FOR_IDLE)}
        s = state.active()
        if s is not self._session:
            self._session, self._traffic, self._traffic_data = s, None, None
            self._described.clear()
            self._dirty, self._refreshed = True, 0.0
        if full:
            snap["kept"] = self._kept()
        if s is None:
            if full:
                snap["rrefs"] = self._rrefs(None)
            return snap
        from rpcnb.membership import view

        refresh = full and time.monotonic() - self._refreshed > REFRESH_EVERY
        if full and not refresh and time.monotonic() - self._busy_at > BUSY_EVERY:
            view.ask_busy(s)  # between two refreshes (which ask it too)
            self._busy_at = time.monotonic()
        group = view.group(refresh=refresh)
        if refresh:
            self._refreshed = self._busy_at = time.monotonic()
        rows = member_rows(group, panel_actions.running_here(s))
        snap.update(message="", members=rows, group={
            "me": group.me, "leader": group.leader, "address": group.address,
            "join_line": group.join_line, "size": len(rows),
            "alive": sum(1 for r in rows if r["alive"]),
        })
        if full:
            snap["traffic"] = self._traffic_now(s)
            snap["rrefs"] = self._rrefs(s)
        return snap

    def _kept(self) -> list[dict[str, Any]]:
        """The user's kept groups (``%rpc_groups``), also while this kernel is in none: the
        records their keepers write, so nothing is asked of any process."""
        from rpcnb.membership import kept

        try:
            return [kept.describe(rec) for rec in kept.groups()]
        except (OSError, RuntimeError):  # no private runtime folder: none to show
            return []

    def _traffic_now(self, s: Any) -> dict[str, Any] | None:
        from rpcnb.observe.traffic import Traffic

        if self._traffic is None:
            try:
                self._traffic = Traffic(s)
            except Exception:
                return None
            self._dirty = True
        remote = time.monotonic() - self._traffic.remote_at > REMOTE_EVERY
        if self._dirty or remote or self._traffic_data is None:
            self._dirty = False
            pic = self._traffic.picture(remote, since=time.time() - SERIES_SECONDS,
                                        points=SERIES_POINTS)
            self._traffic_data = {"members": pic.members, "matrix": pic.matrix,
                                  "series": pic.series}
        return self._traffic_data

    def _note(self, found: dict[str, Held]) -> None:
        now = time.time()
        with self.lock:
            for key in found:
                self._seen.setdefault(key, now)

    def _rrefs(self, s: Any) -> list[dict[str, Any]]:
        found = find_rrefs(self.shell.user_ns)
        self._note(found)
        out = []
        for key, held in found.items():
            entry = {"key": key, "names": held.names, "since": self._seen.get(key, time.time())}
            entry.update(self._describe(s, key, held.rref))
            out.append(entry)
        out.sort(key=lambda e: (e["since"], e["names"]))
        return out

    def _describe(self, s: Any, key: str, rref: Any) -> dict[str, Any]:
        """Owner, type, shape, dtype, device, size, preview: asked of the owner once."""
        if s is None:
            cached = self._described.get(key)
            return dict(cached[1], error="its group has ended") if cached else \
                {"owner": "?", "error": "its group has ended"}
        cached = self._described.get(key)
        if cached and (cached[0] == 0.0 or time.monotonic() - cached[0] < DESCRIBE_RETRY):
            return cached[1]
        try:
            owner = rref.owner_name()
        except Exception as exc:
            return {"owner": "?", "error": _first_line(exc)}
        how = s.how_gone(owner)
        if how is not None:
            info: dict[str, Any] = {"owner": owner, "error": f"{owner} is gone ({how})"}
            self._described[key] = (0.0, info)
            return info
        owner, described, error = rrefs.describe_rref(rref)
        info = {"owner": owner, "error": error}
        if described is not None:
            info.update({k: v for k, v in described.items() if k != "preview"})
            info["preview"] = described.get("preview", "")[:200]
        self._described[key] = (0.0 if described is not None else time.monotonic(), info)
        return info

    # -- actions ----------------------------------------------------------------------------

    def _act(self, kind: str) -> None:
        line = self.actions[kind]
        while True:
            try:
                asked = line.get(timeout=30)
            except queue.Empty:
                with self.lock:
                    if line.empty():
                        self.actors.pop(kind, None)
                        return
                continue
            link, data = asked.link, asked.data
            reply: dict[str, Any] = {"type": "reply", "id": data.get("id"), "ok": True}
            try:
                if kind == "wait":
                    self.idle.wait()  # the running cell ends first (docs/panel.md)
                reply.update(self.act(str(data.get("action")), data))
            except Exception as exc:
                reply.update(ok=False, message=str(exc).strip() or type(exc).__name__)
            try:
                link.comm.send(reply)
            except Exception:
                pass
            self.wake.set()

    def act(self, action: str, data: dict[str, Any]) -> dict[str, Any]:
        """Run one of the panel's actions (``panel_actions.ACTIONS``); what to tell the
        panel (``message``, and for ``open`` the line of the cell the front end adds and
        runs: ``insert``)."""
        return panel_actions.act(self, action, data)

    def size_of(self, key: str) -> int:
        """The bytes of the value RRef ``key`` holds, as the panel described it (0: not
        known)."""
        return int(self._described.get(key, (0.0, {}))[1].get("nbytes") or 0)

    def forget(self, key: str) -> None:
        """RRef ``key`` was dropped: what the panel noted of it goes."""
        with self.lock:
            self._seen.pop(key, None)
        self._described.pop(key, None)


@dataclass
class Link:
    """One front end's comm: how much it wants ("full", "summary": the status item's
    counts only, "off"), and the last picture it got."""

    comm: Any
    detail: str = "full"
    last: str = ""


@dataclass(frozen=True)
class Asked:
    """An action a panel asked for (its message's data), waiting in its line."""

    link: Link  # the panel that asked: the reply goes there
    data: dict[str, Any]


def _summary(snap: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in snap.items() if k not in ("traffic", "rrefs", "kept")}


@functools.cache
def _publisher_of(shell: Any) -> Publisher:
    """The kernel's one publisher: made by the first ``register``, kept by every later one
    (``%reload_ext rpcnb``), so the panels already connected stay served."""
    return Publisher(shell)


def publisher() -> Publisher | None:
    """This kernel's publisher (None outside a kernel)."""
    from IPython import get_ipython

    shell = get_ipython()
    return _publisher_of(shell) if getattr(shell, "kernel", None) is not None else None


def register(ip: Any) -> None:
    """``%load_ext rpcnb``: the comm target, the before- and after-cell hooks and the hello.
    Nothing happens outside a kernel (a terminal IPython has no front end to talk to)."""
    if getattr(ip, "kernel", None) is None:
        return
    import comm

    pub = _publisher_of(ip)
    comm.get_comm_manager().register_target(TARGET, pub.open)
    for event, hook in (("pre_run_cell", pub.before_cell), ("post_run_cell", pub.after_cell)):
        with contextlib.suppress(ValueError):  # not there yet: this is the first %load_ext
            ip.events.unregister(event, hook)
        ip.events.register(event, hook)
    try:
        hello = comm.create_comm(target_name=TARGET, comm_id=HELLO_ID, primary=False)
        hello.send({"hello": PROTOCOL})
        hello._closed = True  # never opened: nothing to close, when collected neither
    except Exception:  # a front end without comms: the panel connects when it looks
        pass
