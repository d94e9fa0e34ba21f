"""``%debug`` and ``%pdb`` on the worker: after a remote cell (or a function called on a
worker with ``rpc_sync``) failed, IPython's post-mortem opens on the worker's frames of
that failure, in the cell, instead of rpcnb's frames in the kernel.

``install`` wraps the shell's ``debugger`` (what ``%debug`` and ``%pdb on`` call) and the
``%debug`` magic (``%debug worker2`` picks a member after a failed ``--all`` cell); a
local failure is debugged by IPython as before. The worker's side is
``rpcnb.cells.console``: it keeps its last failure and runs pdb on it as a cell.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any

from rpcnb import errors
from rpcnb.session import state

# how torch names the member a remote exception came from ("On WorkerInfo(id=1, name=w1):")
REMOTE_CALL = re.compile(r"On WorkerInfo\(id=\d+, name=([^)\s,]+)\)")
WORKER_NAME = re.compile(r"[A-Za-z_][\w.-]*")
POST_MORTEM = "__import__('rpcnb.cells.console', fromlist=['post_mortem']).post_mortem({kind!r})"


@dataclass
class Target:
    """Where a failure is debugged: a worker, and whether it was a cell's or a call's."""

    worker: str
    kind: str = "cell"  # "call": a function another member called there (rpc_sync)
    others: list[str] = field(default_factory=list)  # other workers that failed too


def _members() -> set[str]:
    if not state.is_initialized():
        return set()
    s = state.current()
    return {n for n, m in list(s.members.items()) if n != s.name and m.alive}


def target(value: Any) -> Target | None:
    """The worker a failure shown in the notebook happened on, or None (a local one)."""
    members = _members()
    if not members or value is None:
        return None
    if isinstance(value, errors.CompositeRemoteError):
        failed = [w for w in value.errors if w in members]
        return Target(failed[0], "cell", failed[1:]) if failed else None
    if isinstance(value, errors.RemoteError):
        return Target(value.worker) if value.worker in members else None
    try:
        m = REMOTE_CALL.search(str(value))
    except Exception:
        return None
    if m and m.group(1) in members:
        return Target(m.group(1), "call")
    return None


def post_mortem(t: Target) -> None:
    """pdb on ``t.worker``'s kept failure, in this cell (a remote cell that runs it)."""
    from rpcnb.cells import call

    if t.others:
        print(errors.DEBUG_OTHERS.format(worker=t.worker, others=", ".join(t.others),
                                         first=t.others[0]), file=sys.stderr)
    try:
        call.run(t.worker, POST_MORTEM.format(kind=t.kind))
    except errors.RemoteError as exc:
        if exc.ename != "NothingToDebug":
            raise
        print(exc.evalue, file=sys.stderr)


def install(ip: Any) -> None:
    """Wrap ``ip.debugger`` and the ``%debug`` magic (once per shell)."""
    if getattr(ip.debugger, "rpcnb_remote", False):
        return
    local_debugger = ip.debugger

    def debugger(force: bool = False) -> None:
        if not (force or ip.call_pdb):
            return
        found = target(getattr(sys, "last_value", None))
        if found is None:
            local_debugger(force)
            return
        post_mortem(found)

    debugger.rpcnb_remote = True  # type: ignore[attr-defined]
    ip.debugger = debugger  # an attribute of the instance: deleting it gives IPython's back

    # IPython's own, loaded now (IPython 9 loads its magics lazily: a placeholder would
    # look the name up again, and find this one)
    line, cell = ip.find_line_magic("debug"), ip.find_cell_magic("debug")
    if line is None or cell is None:
        return

    def debug(arg: str = "", body: str | None = None) -> Any:
        """%debug as IPython's; ``%debug WORKER``: the last failure on that worker."""
        name = arg.strip()
        if body is None and WORKER_NAME.fullmatch(name or "-") and name in _members():
            found = target(getattr(sys, "last_value", None))
            kind = found.kind if found is not None and found.worker == name else "cell"
            post_mortem(Target(name, kind))
            return None
        return line(arg) if body is None else cell(arg, body)

    debug.__doc__ = (line.__doc__ or "") + (
        "\n\nrpcnb: after a remote cell failed, %debug opens pdb on the worker's frames; "
        "%debug WORKER on that worker's last failure.")
    debug.rpcnb_originals = (line, cell)  # type: ignore[attr-defined]  # uninstall's
    ip.register_magic_function(debug, "line_cell", "debug")


def uninstall(ip: Any) -> None:
    """IPython's own ``debugger`` and ``%debug`` again (``%unload_ext rpcnb``)."""
    if getattr(ip.debugger, "rpcnb_remote", False):
        del ip.debugger
    # IPython's own %debug, line and cell, kept by the one rpcnb put in its place
    found = getattr(ip.magics_manager.magics["line"].get("debug"), "rpcnb_originals", None)
    if found is not None:
        ip.magics_manager.magics["line"]["debug"] = found[0]
        ip.magics_manager.magics["cell"]["debug"] = found[1]
