"""Everything the JupyterLab panel can ask of this kernel, in one table (``ACTIONS``), as
``membership.handlers.OPERATIONS`` is for the requests of other members.

The front end (``labextension/src/actions.ts``) sends an action as a comm message; the
kernel's ``panel.Publisher`` runs it on one of its two action threads (``act``). Each
handler takes the panel first (the kernel's shell, and what the panel noted of the RRefs
it showed), then the message, and returns what to tell the panel: ``message``, and for
some ``text``, ``table``, ``copy`` or the line of a cell to add and run (``insert``). A
user's mistake is a ``ValueError`` whose sentence the panel shows.
"""

from __future__ import annotations

import keyword
from collections.abc import Callable
from typing import Any, Protocol

from rpcnb import errors
from rpcnb.frontend import rrefs
from rpcnb.frontend.held import drop, find_rrefs
from rpcnb.procs import launch
from rpcnb.sandbox import isolation
from rpcnb.session import state
from rpcnb.wire import options

BAD_VARIABLE = "{name!r} is not a valid Python variable name: use letters, digits and _."
GONE = "This RRef is no longer held by this kernel (the panel showed an older picture)."
BAD_WORKERS = "The number of workers must be a whole number from 0 to 64, not {value!r}."
UNKNOWN_ACTION = "The panel asked for {action!r}, which this rpcnb does not know: upgrade rpcnb."
NOT_A_WORKER = "{name!r} is no worker of this group (its members: {members})."
NOT_MINE = ("{name} is {what}: restart and interrupt act on the workers this kernel "
            "started (the leader's, from its notebook).")
BAD_ADD = "The number of workers to add must be a whole number from 1 to 64, not {value!r}."
OPENS = {"channels": "%rpc_channels", "devmap": "%rpc_devmap"}
KEPT_ENDED = "ended kept group {group}: its workers are stopped, nothing is left."
ATTACH_ADDED = "%rpc_init --attach {group} added to the notebook"
DEVMAP_NO_GROUP = (
    "There is no group to edit a map for: start one first, or run "
    "%rpc_devmap --topology worker0=2,worker1=2 to plan one."
)


class Panel(Protocol):
    """What an action needs of the kernel's side of the panel (``panel.Publisher``)."""

    shell: Any  # the kernel's IPython shell: its user_ns is the notebook's namespace

    def size_of(self, key: str) -> int: ...

    def forget(self, key: str) -> None: ...


def act(panel: Panel, action: str, data: dict[str, Any]) -> dict[str, Any]:
    """Run the panel's action ``action`` with its message ``data``: what to tell the panel."""
    if action not in ACTIONS:
        raise ValueError(UNKNOWN_ACTION.format(action=action))
    return ACTIONS[action](panel, data)


def running_here(s: Any) -> set[str]:
    """The workers running a remote cell of this kernel's now."""
    if s is None:
        return set()
    return {c.worker for c in s.calls_to()}


# -- the group ------------------------------------------------------------------------------


def start(panel: Panel, data: dict[str, Any]) -> dict[str, Any]:
    """A new group with ``workers`` workers (and the device map given, or applied)."""
    device_map = str(data.get("device_map") or "")
    workers = _count(data.get("workers", 2), 0, BAD_WORKERS)
    kwargs: dict[str, Any] = {}
    if device_map.strip():
        kwargs["device_map"] = options.device_map_spec(device_map, panel.shell.user_ns)
    elif options.applied_device_map() is not None:
        kwargs["device_map"] = options.applied_device_map()  # what the editor applied
    launch.apply_quiet_env()  # before torch is imported, as %rpc_init does
    from rpcnb import api

    group = api.init(workers, **kwargs)
    note = isolation.notice()
    return {"message": f"started: {', '.join(m.name for m in group.members)}; others join "
                       f"with {group.join_line}" + (f"\n{note}" if note else "")}


def shutdown(panel: Panel, data: dict[str, Any]) -> dict[str, Any]:
    if not state.is_initialized():
        raise ValueError(errors.NOT_INITIALIZED)
    from rpcnb import api

    api.shutdown()
    return {"message": "left the group; start a new one below or with %rpc_init."}


def add(panel: Panel, data: dict[str, Any]) -> dict[str, Any]:
    n = _count(data.get("n", 1), 1, BAD_ADD)
    from rpcnb import api

    before = {m.name for m in api.group().members}
    after = api.add_workers(n)
    return {"message": "added: " + ", ".join(
        m.name for m in after.members if m.name not in before)}


def join(panel: Panel, data: dict[str, Any]) -> dict[str, Any]:
    """The line another kernel on this host runs to join, for the clipboard."""
    from rpcnb import api

    line = api.group().join_line
    return {"message": f"copied: {line}", "copy": line}


def restart(panel: Panel, data: dict[str, Any]) -> dict[str, Any]:
    from rpcnb import api

    name = _started_here(str(data.get("member", "")))
    api.restart(name)
    return {"message": f"restarted {name} (a new process: its namespace starts empty)."}


def interrupt(panel: Panel, data: dict[str, Any]) -> dict[str, Any]:
    """The remote cell a worker runs for this kernel."""
    from rpcnb import api

    name = _started_here(str(data.get("member", "")))
    if name not in running_here(state.active()):
        return {"message": f"{name} runs no cell of this kernel's: nothing to interrupt."}
    api.interrupt(name)
    return {"message": f"interrupted the cell {name} was running; {name} and its "
                       "namespace stay."}


def _count(value: Any, low: int, message: str) -> int:
    """A number of workers as the panel sent it (a number, or its digits), from ``low`` to
    64; ValueError with ``message`` otherwise."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= 64:
        raise ValueError(message.format(value=value))
    return value


def _started_here(name: str) -> str:
    """``name``, if it is a worker process this kernel started (restart and interrupt act
    on those only); ValueError saying what it is otherwise."""
    from rpcnb import api

    group = api.group()
    member = next((m for m in group.members if m.name == name), None)
    if member is None:
        raise ValueError(NOT_A_WORKER.format(
            name=name, members=", ".join(m.name for m in group.members)))
    if member.name == group.me or member.kind != "process":
        what = "this kernel" if member.name == group.me else f"a {member.kind}"
        raise ValueError(NOT_MINE.format(name=name, what=what))
    return name


# -- kept groups ----------------------------------------------------------------------------


def attach(panel: Panel, data: dict[str, Any]) -> dict[str, Any]:
    """A cell that attaches to the kept group (the one there is, for ""), so that the
    notebook shows what attach found; if this kernel can attach now: it is in no group,
    and no other kernel is attached there."""
    from rpcnb.membership import kept

    if state.is_initialized():
        raise ValueError(errors.ALREADY_INITIALIZED.format(name=state.current().name))
    rec = kept.find(str(data.get("group", "")) or None)
    kernel = kept.attached(rec)
    if kernel:
        raise ValueError(errors.KEPT_ATTACHED.format(
            group=rec.name, kernel=kernel, pid=rec.attached_pid or kernel.rsplit("-", 1)[-1]))
    return {"message": ATTACH_ADDED.format(group=rec.name),
            "insert": f"%rpc_init --attach {rec.name}"}


def end(panel: Panel, data: dict[str, Any]) -> dict[str, Any]:
    """End a kept group: as %rpc_shutdown where this kernel drives it, else as
    %rpc_shutdown --group."""
    from rpcnb import api

    group = str(data.get("group", ""))
    s = state.active()
    if s is not None and s.kept_group == group:
        api.shutdown()
    else:
        api.end_group(group)
    return {"message": KEPT_ENDED.format(group=group)}


# -- looking at a member --------------------------------------------------------------------


def probe(panel: Panel, data: dict[str, Any]) -> dict[str, Any]:
    from rpcnb.observe import probe as probes

    results = probes.probe(progress=False)
    return {"message": "probed: " + ", ".join(
        f"{p.peer} {p.latency_s * 1e3:.2f} ms" for p in results.peers),
        "table": results.table()}


def stacks(panel: Panel, data: dict[str, Any]) -> dict[str, Any]:
    from rpcnb.observe import stacks as threads

    name = str(data.get("member", ""))
    return {"message": f"{name}'s threads now:", "text": str(threads.stacks([name]))}


def who(panel: Panel, data: dict[str, Any]) -> dict[str, Any]:
    """A member's variables, as %rpc_who lists them."""
    from rpcnb.observe.names import who as variables

    name = str(data.get("member", ""))
    found = variables([name]).get(name)
    if found.state != "answered":
        raise ValueError(found.summary())
    return {"message": found.summary(), "member": name, "variables": found.rows,
            "text": found.table() if found.rows else ""}


# -- the notebook's RRefs and cells ---------------------------------------------------------


def fetch(panel: Panel, data: dict[str, Any]) -> dict[str, Any]:
    """The value an RRef the panel showed holds, into the notebook as ``name``."""
    ns = panel.shell.user_ns
    name = str(data.get("name", "")).strip()
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(BAD_VARIABLE.format(name=name))
    key = str(data.get("key"))
    held = find_rrefs(ns).get(key)
    if held is None:
        raise ValueError(GONE)
    # a value the panel described (its size known) gets a limit that grows with it
    nbytes = panel.size_of(key)
    value = held.rref.to_here(timeout=rrefs.time_limit(nbytes)) if nbytes \
        else held.rref.to_here()
    replaced = name in ns
    ns[name] = value
    return {"message": f"{name} = {type(value).__name__} from {held.rref.owner_name()}"
                       + (f" (the old {name} was replaced)" if replaced else "")}


def free(panel: Panel, data: dict[str, Any]) -> dict[str, Any]:
    """Every name the notebook holds an RRef by, dropped: its owner lets go of the value."""
    key = str(data.get("key"))
    names = drop(panel.shell, key)
    if not names:
        raise ValueError(GONE)
    panel.forget(key)
    return {"message": f"freed: {', '.join(names)} dropped; its owner lets go of it."}


def open_cell(panel: Panel, data: dict[str, Any]) -> dict[str, Any]:
    """A cell that shows a widget (``OPENS``)."""
    what = str(data.get("what"))
    if what not in OPENS:
        raise ValueError(UNKNOWN_ACTION.format(action=f"open {what}"))
    import importlib.util

    if importlib.util.find_spec("anywidget") is None:
        from rpcnb.frontend.widgets import NEEDS_ANYWIDGET

        raise ValueError(NEEDS_ANYWIDGET)
    if not state.is_initialized():
        raise ValueError(errors.NOT_INITIALIZED if what == "channels" else DEVMAP_NO_GROUP)
    return {"message": f"{OPENS[what]} added to the notebook", "insert": OPENS[what]}


ACTIONS: dict[str, Callable[[Panel, dict[str, Any]], dict[str, Any]]] = {
    "start": start,
    "shutdown": shutdown,
    "add": add,
    "join": join,
    "restart": restart,
    "interrupt": interrupt,
    "attach": attach,
    "end": end,
    "probe": probe,
    "stacks": stacks,
    "who": who,
    "fetch": fetch,
    "free": free,
    "open": open_cell,
}
