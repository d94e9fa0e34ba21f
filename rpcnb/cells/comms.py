"""Widgets made on a worker, live in the notebook: a worker's comms (the channel behind
every ipywidgets, anywidget and ``tqdm.notebook`` widget) are relayed through the kernel.

On a worker process there is no front end, so ``comm.create_comm`` made dummies: the
notebook got a widget's view but never its model ("model not found"). ``install_worker``
makes it create a ``ForwardedComm`` instead, whose messages (open, message, close) travel
with the cell's output, in order, so the model is open before its view is shown. In the
kernel, ``relay`` opens a real comm with the same id for each, towards the front end, and
sends what the front end says to it (a slider moved, a button clicked) back to the worker
(the ``comm`` operation), where the widget handles it as in a kernel. A message for a
widget whose worker is gone is dropped, with one warning per worker; when a worker dies or
the group shuts down, its widgets are closed in the front end.

Inside ``with output_widget:`` on a worker, what the code prints and displays goes into
that ``ipywidgets.Output`` (``interact`` shows its results there), not into the cell.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

from rpcnb import progress
from rpcnb.cells import output
from rpcnb.session import protocol, state

KIND = "comm"  # an output item of this kind carries a comm message
ORDER_WAIT = 2.0  # seconds the kernel waits for a worker to take what the front end said
GONE = ("rpcnb: a widget made on {worker} was used, but {worker} is gone ({how}): its "
        "widgets no longer answer. Run the cell again on a live worker.")
MISSING = ("{module} is not installed on {worker}: widgets made there need it in the "
           "worker's environment (`pip install {package}` there, or rpcnb[widgets]).")
# what a missing module is installed as
PACKAGES = {"ipywidgets": "ipywidgets", "anywidget": "anywidget", "IProgress": "ipywidgets",
            "comm": "comm"}


# -- on a worker ---------------------------------------------------------------------------

@functools.cache  # once per process
def install_worker() -> None:
    """Comms made in this process (a worker process: no front end of its own) are relayed
    to the member whose cell made them (once; nothing is imported until a widget is made)."""
    try:
        import comm
    except ImportError:  # no widget library can work without it
        return
    comm.create_comm = _create_comm


def _create_comm(*args: Any, **kwargs: Any) -> Any:
    _patch_output_widget()
    return _forwarded_class()(*args, **kwargs)


@functools.cache  # made at the first widget: comm is imported then
def _forwarded_class() -> Any:
    from comm.base_comm import BaseComm

    class ForwardedComm(BaseComm):
        """A comm whose other end is the notebook's front end, through the kernel."""

        def publish_msg(self, msg_type: str, data: Any = None, metadata: Any = None,
                        buffers: Any = None, **keys: Any) -> None:
            cap = output.router.current()
            if cap is None:
                return  # outside any cell, and no one to send it to
            cap.display(KIND, {
                "type": msg_type, "comm_id": self.comm_id, "data": data or {},
                "metadata": metadata or {},
                "buffers": [bytes(b) for b in buffers or ()],
                "target_name": keys.get("target_name", self.target_name),
                "target_module": keys.get("target_module", self.target_module),
            })

    return ForwardedComm


def incoming(comm_id: str, kind: str, msg: dict[str, Any]) -> bool:
    """What the front end sent to the widget ``comm_id`` (kind ``comm_msg`` or
    ``comm_close``): handled here as a kernel would. False if there is no such widget."""
    import comm

    manager = comm.get_comm_manager()
    c = manager.get_comm(comm_id)
    if c is None:
        return False
    full = {"header": {"msg_type": kind}, "parent_header": {}, "metadata": msg.get("metadata", {}),
            "content": {"comm_id": comm_id, "data": msg.get("data", {})},
            "buffers": [memoryview(b) for b in msg.get("buffers", [])]}
    if kind == "comm_close":
        c._closed = True
        manager.unregister_comm(c)
        c.handle_close(full)
    else:
        c.handle_msg(full)
    return True


def _patch_output_widget() -> None:
    """``with out:`` for an ``ipywidgets.Output`` on a worker sends what is printed or
    displayed inside into ``out`` (in a kernel the front end does this by message id,
    which a worker's output does not carry). Once ipywidgets is imported; the class says
    it was patched."""
    mod = sys.modules.get("ipywidgets.widgets.widget_output")
    if mod is None or getattr(mod.Output, "rpcnb_patched", False):
        return
    cls = mod.Output
    cls.rpcnb_patched = True

    def enter(self: Any) -> Any:
        stack = output.router.widget_outputs()
        stack.append(self)
        return self

    def exit_(self: Any, etype: Any, evalue: Any, tb: Any) -> Any:
        stack = output.router.widget_outputs()
        if stack and stack[-1] is self:
            stack.pop()
        if etype is not None and etype is not KeyboardInterrupt:
            import traceback

            self.append_stderr("".join(traceback.format_exception(etype, evalue, tb)))
            return True  # shown in the widget, as a kernel shows it
        return None

    cls.__enter__ = enter
    cls.__exit__ = exit_


def hint(exc: BaseException, worker: str) -> str | None:
    """What to install on ``worker`` when ``exc`` says a widget library is missing there."""
    if not isinstance(exc, ImportError):
        return None
    name = (getattr(exc, "name", None) or "").split(".")[0]
    if not name and "IProgress" in str(exc):
        name = "IProgress"  # tqdm.notebook without ipywidgets
    if name not in PACKAGES:
        return None
    module = "ipywidgets" if name == "IProgress" else name
    return MISSING.format(module=module, worker=worker, package=PACKAGES[name])


# -- in the kernel -------------------------------------------------------------------------


class _Relayed:
    """The kernel's comms that stand for workers' widgets."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.comms: dict[str, tuple[str, Any]] = {}  # comm id -> (worker, kernel comm)
        self.warned: set[str] = set()

    def close_of(self, worker: str | None = None) -> int:
        """Close (in the front end) the widgets of ``worker``, or of every worker."""
        with self.lock:
            ids = [cid for cid, (w, _) in self.comms.items() if worker is None or w == worker]
            gone = [self.comms.pop(cid)[1] for cid in ids]
        for kc in gone:
            try:
                kc.close()
            except Exception:
                pass
        return len(gone)


relayed = _Relayed()


def relay(worker: str, payload: dict[str, Any]) -> None:
    """A comm message from ``worker``'s widget: to the front end, through a comm of this
    kernel with the same id (opened at the widget's ``comm_open``)."""
    kind, cid = payload.get("type"), payload.get("comm_id")
    if not isinstance(cid, str):
        return
    if kind == "comm_open":
        import comm

        kc = comm.create_comm(target_name=payload.get("target_name") or "comm",
                              data=payload.get("data"), metadata=payload.get("metadata"),
                              buffers=payload.get("buffers") or None, comm_id=cid,
                              target_module=payload.get("target_module"))
        kc.on_msg(lambda msg: _to_worker(worker, cid, "comm_msg", msg))
        kc.on_close(lambda msg: _closed_by_front_end(worker, cid, msg))
        with relayed.lock:
            relayed.comms[cid] = (worker, kc)
        _close_with_group()
        return
    with relayed.lock:
        found = relayed.comms.get(cid)
        if kind == "comm_close":
            relayed.comms.pop(cid, None)
    if found is None:
        return
    kc = found[1]
    if kind == "comm_msg":
        kc.send(data=payload.get("data"), metadata=payload.get("metadata"),
                buffers=payload.get("buffers") or None)
    elif kind == "comm_close":
        kc.close(data=payload.get("data"), metadata=payload.get("metadata"))


CLOSE_STEP = "workers' widgets"


def _close_with_group() -> None:
    """The group's teardown closes the widgets its workers made. Asked of the group's own
    stack, once per group: a kernel's later group may get an earlier one's ``id``, and
    reuses its members' names, so the warnings about gone workers start over too."""
    s = state.active()
    if s is None or CLOSE_STEP in s.teardown.names():
        return
    with relayed.lock:
        relayed.warned.clear()
    s.teardown.push(CLOSE_STEP, relayed.close_of)


def _closed_by_front_end(worker: str, cid: str, msg: dict[str, Any]) -> None:
    with relayed.lock:
        relayed.comms.pop(cid, None)
    _to_worker(worker, cid, "comm_close", msg)


def _to_worker(worker: str, cid: str, kind: str, msg: dict[str, Any]) -> None:
    """Send what the front end said to a relayed widget on to its worker."""
    s = state.active()
    how = "the group has ended" if s is None else s.how_gone(worker)
    if how is not None:
        _gone(worker, how)
        return
    assert s is not None
    content = msg.get("content", {})
    sendable = {"data": content.get("data", {}), "metadata": msg.get("metadata", {}),
                "buffers": [bytes(b) for b in msg.get("buffers") or ()]}
    try:
        fut = protocol.call_async(s.token, worker, "comm", cid, kind, sendable, timeout=10,
                                  nbytes=progress.payload_bytes(sendable, depth=3))
    except Exception as exc:
        _gone(worker, f"{type(exc).__name__}: {exc}")
        return

    arrived = threading.Event()

    def done(f: Any) -> None:
        try:
            f.wait()
        except Exception as exc:
            _gone(worker, s.how_gone(worker) or f"{type(exc).__name__}: {exc}")
        finally:
            arrived.set()

    fut.add_done_callback(done)
    # The widget has it before this kernel takes its next message (a cell run after the
    # slider moved sees the new value), unless the worker takes longer than this to answer.
    arrived.wait(ORDER_WAIT)


def _gone(worker: str, how: str) -> None:
    relayed.close_of(worker)
    if worker in relayed.warned:
        return
    relayed.warned.add(worker)
    print(GONE.format(worker=worker, how=how), file=sys.__stderr__ if output.shell() is None
          else sys.stderr)


def worker_died(worker: str) -> None:
    """``worker`` died or left: its widgets close in the front end."""
    relayed.close_of(worker)


