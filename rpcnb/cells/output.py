"""A remote cell's output: captured where the cell runs, sent to the caller in small
batches while it runs, and printed there into the cell that asked.

Where the cell runs, ``sys.stdout``, ``sys.stderr`` and IPython's display publisher are
wrapped (``install_routing``) so that a write goes to the ``Capture`` of the cell this
thread runs, else (in a worker process) to the cell the process runs, else to the
process's background capture, else where it would have gone. Text is coalesced and sent
every ``FLUSH_INTERVAL``; ``display()`` and ``clear_output()`` are sent at once. A line
rewritten with carriage returns (a progress bar) is sent as what a terminal would show
(``squash``): a 4 s tqdm bar is a few dozen batches, not thousands of writes. A cell's
or call's ``Capture`` is made at its first write: most write nothing.

Where the cell was asked for, ``rpcnb.cells.printer`` writes each batch into the cell.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from typing import Any

from rpcnb import machine, progress, waiting
from rpcnb.cells.frames import rpc_me, sendable, user_traceback
from rpcnb.session import protocol, state
from rpcnb.wire import limits

FLUSH_INTERVAL = 0.1  # seconds between output batches while a cell runs
HELD_CHARS = 1 << 20  # of a cell's output kept while its caller is gone (the last part)


def squash(text: str, final: bool = True) -> str:
    """``text`` as a terminal would show it, line by line: a line rewritten with carriage
    returns keeps only its last version (after a ``\r`` that stays, so that where it is
    shown it still overwrites what the line held). ``\r\n`` ends a line like ``\n``.
    ``final``: the text's last part is an unfinished line (its trailing ``\r`` stays)."""
    if "\r" not in text:
        return text
    parts = text.split("\n")
    for i, part in enumerate(parts):
        if "\r" not in part:
            continue
        last = final and i == len(parts) - 1
        core = part.rstrip("\r")
        cr = core.rfind("\r")
        if cr >= 0:
            core = "\r" + core[cr + 1:]
        parts[i] = core + ("\r" if last and part.endswith("\r") else "")
    return "\n".join(parts)


class Capture:
    """Output of one remote cell (or, with ``call_id=None``, of a worker process outside
    any cell), batched and sent to ``caller`` as it arrives."""

    def __init__(self, call_id: str | None, caller: str, worker: str, token: str) -> None:
        self.call_id = call_id
        self.token = token
        self.caller = caller
        self.worker = worker
        self._lock = threading.Lock()
        # held from taking a batch until its delivery is registered: a close() on the
        # cell's thread waits for a flush the flusher thread is in the middle of (else it
        # could see neither the batch nor its delivery, and the result overtook the output)
        self._sending = threading.Lock()
        self._items: list[tuple[Any, ...]] = []
        self._seq = 0
        self._futures: list[tuple[Any, int]] = []  # (delivery, its bytes)
        self.large = False  # a batch was large: memory to give back once delivered
        # the caller went away (rpcnb.cells.orphans): batches are kept here, not sent
        self.held: list[tuple[Any, ...]] | None = None
        self._held_chars = 0

    def write(self, stream: str, text: str) -> None:
        if not text:
            return
        with self._lock:
            if self._items and self._items[-1][0] == stream:
                before = self._items[-1][1]
                if "\r" in text:  # a line rewritten: keep its last version only
                    cut = before.rfind("\n") + 1
                    joined = before[:cut] + squash(before[cut:] + text)
                else:
                    joined = before + text
                self._items[-1] = (stream, joined)
            else:
                self._items.append((stream, squash(text) if "\r" in text else text))

    def display(self, kind: str, payload: dict[str, Any]) -> None:
        with self._lock:
            self._items.append((kind, payload))
        self.flush()

    def mark(self, payload: dict[str, Any]) -> None:
        """A transfer's progress mark that goes with the next batch (the flusher sends it
        within FLUSH_INTERVAL while the cell runs); dropped if the cell ends first: its
        result says as much, without a round trip of its own."""
        with self._lock:
            self._items.append(("progress", payload))

    def out_of_band(self, kind: str, payload: dict[str, Any]) -> None:
        """Send one item now, outside the batches' order: nothing waits for it."""
        with contextlib.suppress(Exception):  # the caller is gone: nobody to show it
            protocol.call_async(self.token, self.caller, "aside", self.call_id,
                                self.worker, [(kind, payload)], timeout=None)

    def hold(self) -> None:
        """Keep what the cell prints from now on instead of sending it: its caller is gone."""
        with self._sending, self._lock:
            if self.held is None:
                self.held = []

    def take(self) -> tuple[list[tuple[Any, ...]], int]:
        """What was kept so far (taken: kept afresh from now on), and the number of the
        next batch that will be sent."""
        with self._sending, self._lock:
            kept = [*(self.held or ()), *self._items]
            self._items = []
            if self.held is not None:
                self.held = []
            return kept, self._seq

    def resume(self, caller: str) -> None:
        """Send to ``caller`` from now on, what was kept since ``take`` first."""
        with self._sending, self._lock:
            self.caller = caller
            self._items[:0] = self.held or ()
            self.held = None
        self.flush()

    def _keep(self, items: list[tuple[Any, ...]]) -> None:
        held = self.held if self.held is not None else []
        if not held:
            self._held_chars = 0
        held.extend(items)
        self._held_chars += sum(_chars(p) for _, p in items)
        while self._held_chars > HELD_CHARS and len(held) > 1:  # a long run's last part
            self._held_chars -= _chars(held.pop(0)[1])
        self.held = held

    def flush(self) -> None:
        with self._sending:
            with self._lock:
                if not self._items:
                    return
                items, self._items = self._items, []
                if self.held is not None:
                    self._keep(items)
                    return
                seq = self._seq
                self._seq += 1
            # the group's RPC timeout, and the time its bytes take at the floor rate on
            # top (a large display over a slow link: rpcnb.wire.limits)
            nbytes = progress.payload_bytes(items, depth=4)
            try:
                fut = protocol.call_async(self.token, self.caller, "deliver", self.call_id,
                                          self.worker, seq, items, timeout=None,
                                          nbytes=nbytes)
            except Exception:  # the caller has left: kept for a kernel that attaches
                with self._lock:
                    self._seq -= 1
                    self._keep(items)
                return
            with self._lock:
                self._futures.append((fut, nbytes))
                self.large = self.large or large(items)

    def settle(self, timeout: float = 10.0) -> None:
        """Send what is written so far and wait until the caller has it (before a prompt:
        ``rpcnb.cells.console``)."""
        self.flush()
        with self._lock:
            futures = [fut for fut, _ in self._futures]
        waiting.until(lambda: all(fut.done() for fut in futures), timeout, every=0.001)

    def close(self, timeout: float = 10.0) -> int:
        """Send what is left, wait until the caller has it (``timeout`` seconds, and the
        time the bytes still on their way take at the floor rate); returns the batch
        count."""
        with self._lock:
            # nothing left and no batch taken (the capture of a cell whose one item was
            # a transfer's mark, say; a flush under way on the flusher thread counts its
            # batch first): none is left to wait for
            if not self._items and not self._seq:
                return 0
            self._items = [item for item in self._items if item[0] != "progress"]
        self.flush()
        pending = sum(n for fut, n in self._futures if not fut.done())
        futures = [fut for fut, _ in self._futures]
        waiting.until(lambda: all(fut.done() for fut in futures),
                      limits.grown(timeout, pending), every=0.001)
        self._futures.clear()
        if self.large:
            machine.give_back_memory()
        return self._seq


LARGE_OUTPUT = 1 << 20  # characters in one batch, after which freed memory is given back


def _chars(payload: Any) -> int:
    """What a kept item counts against HELD_CHARS (a display: a thousand)."""
    return len(payload) if isinstance(payload, str) else 1000


def large(items: list[Any]) -> bool:
    """Whether a batch of output is large enough to give the memory back afterwards."""
    return sum(len(p) for k, p in items if k in ("stdout", "stderr")) >= LARGE_OUTPUT


class _Local(threading.local):
    """A thread's routing (class defaults: a missing attribute of a plain threading.local
    costs half a microsecond, on every call another member makes)."""

    capture: Capture | None = None  # the capture of the cell or call this thread runs
    # the cell's or call's (call_id, caller, worker, token) while it has written nothing:
    # its Capture is made at its first write (most write nothing)
    pending: tuple[str | None, str, str, str] | None = None
    widget_outputs: list[Any] | None = None


class _Threads:
    """The threads of this process at one moment, started ones included (``t in``: was
    ``t`` among them): a copy of threading's own table, without ``threading.enumerate()``'s
    lock and list, and without hashing each thread (a cell takes one as it begins)."""

    __slots__ = ("active", "limbo")

    def __init__(self) -> None:
        active, limbo = getattr(threading, "_active", None), getattr(threading, "_limbo", None)
        if type(active) is dict and type(limbo) is dict:
            # limbo first: a thread that leaves it for the running table meanwhile is in
            # one copy or the other (the other order could miss it)
            self.limbo: tuple[threading.Thread, ...] = tuple(limbo) if limbo else ()
            self.active: dict[Any, threading.Thread] = active.copy()  # ident -> thread
        else:  # another Python's threading: its public view
            threads = threading.enumerate()
            self.active = {t.ident: t for t in threads if t.ident is not None}
            self.limbo = tuple(t for t in threads if t.ident is None)

    def __contains__(self, thread: threading.Thread) -> bool:
        # an ident is reused once its thread ends: the thread itself must be the one seen
        return self.active.get(thread.ident) is thread or thread in self.limbo


class _Cell:
    """A cell a worker process runs (its output is the whole process's): its capture's
    arguments (call_id, caller, worker, token), the thread it runs on, the threads that
    existed when it began, and its capture once something wrote. Threads read it as one
    object, so a thread of an ended cell never writes into the next cell's capture."""

    __slots__ = ("args", "ident", "before", "capture")

    def __init__(self, args: tuple[str | None, str, str, str]) -> None:
        self.args = args
        self.ident = threading.get_ident()
        self.before = _Threads()
        self.capture: Capture | None = None


class _Router:
    """Which capture a write goes to (see the module's docstring)."""

    def __init__(self) -> None:
        self.local = _Local()
        self.lock = threading.Lock()
        self.active: dict[int, Capture] = {}  # thread id -> capture, for the flusher
        self.cell: _Cell | None = None  # in a worker process: the cell it runs
        self.background: Capture | None = None  # in a worker process: outside any cell
        self.installed = False
        # called with a failed call's exception and function name (a worker keeps it)
        self.on_call_failure: Any = None

    def widget_outputs(self) -> list[Any]:
        """The ``ipywidgets.Output`` widgets this thread is inside (``with out:``), innermost
        last: what it prints and displays goes into the innermost (rpcnb.cells.comms)."""
        stack = self.local.widget_outputs
        if stack is None:
            stack = self.local.widget_outputs = []
        return stack

    def current(self) -> Capture | None:
        """Where a write of this thread goes now (the capture is made at the first)."""
        local = self.local
        cap = local.capture
        if cap is not None:
            return cap
        pending = local.pending
        if pending is not None:  # the cell or call this thread runs: its first write
            return self._open(pending, own=True)
        # the running cell gets the output of the threads it started, not of threads
        # older than it (a thread an earlier cell left running prints to the background)
        cell = self.cell
        if cell is not None and threading.current_thread() not in cell.before:
            return cell.capture or self._open(cell.args, own=False)
        return self.background

    def where(self) -> tuple[str | None, str, str, str] | None:
        """(call_id, caller, worker, token) of the cell or call whose output this thread's
        writes go to (None for a call another member made: it has no call id), or None
        outside any (a thread an earlier cell left running, a process's own thread)."""
        local = self.local
        cap = local.capture
        if cap is not None:
            return (cap.call_id, cap.caller, cap.worker, cap.token)
        if local.pending is not None:
            return local.pending
        cell = self.cell
        if cell is not None and threading.current_thread() not in cell.before:
            return cell.args
        return None

    def opened(self) -> Capture:
        """The capture of the cell or call the calling thread runs, made now if nothing
        has written yet (a transfer's progress goes with its output)."""
        cap = self.local.capture
        if cap is None:
            args = self.local.pending
            assert args is not None, "this thread runs no cell or call"
            cap = self._open(args, own=True)
            assert cap is not None  # its own capture, never the background
        return cap

    def cell_capture(self, call_id: str) -> Capture | None:
        """The capture of the cell ``call_id`` that this worker process runs now, made now
        if nothing has written yet; None when it runs no such cell (or is a kernel)."""
        with self.lock:
            cell = self.cell
            if cell is None or cell.args[0] != call_id:
                return None
            if cell.capture is None:
                cell.capture = Capture(*cell.args)
                self.active[cell.ident] = cell.capture
            return cell.capture

    def _open(self, args: tuple[str | None, str, str, str], own: bool) -> Capture | None:
        """The capture of the cell or call ``args``, made at its first write: by the thread
        that runs it (``own``), or by a thread that cell started, whose cell may have
        ended since (its write then goes to the background). A worker process's cell has
        one capture for all its threads, whichever writes first."""
        with self.lock:
            cell = self.cell
            if cell is not None and cell.args is args:
                cap = cell.capture
                if cap is None:
                    cap = cell.capture = Capture(*args)
                    self.active[cell.ident] = cap
                if own:
                    self.local.capture = cap
                return cap
            if not own:
                return self.background
            cap = self.local.capture = Capture(*args)
            self.active[threading.get_ident()] = cap
            return cap

    def enter(self, args: tuple[str | None, str, str, str], process_wide: bool) -> None:
        """The calling thread runs the cell or call ``args`` (the whole process does, with
        ``process_wide``, so threads the cell starts are captured too). Its ``Capture`` is
        made at its first write: ``leave`` returns it, or None when nothing wrote."""
        local = self.local
        local.capture = None  # one an interrupted cell may have left is not this one's
        local.pending = args
        if process_wide:
            cell = _Cell(args)
            with self.lock:
                self.active.pop(cell.ident, None)
                self.cell = cell

    def leave(self, process_wide: bool) -> Capture | None:
        """The calling thread's cell or call ended: its capture, if anything wrote."""
        local = self.local
        cap = local.capture
        local.capture = local.pending = None
        if cap is None and not process_wide:
            return None
        with self.lock:
            self.active.pop(threading.get_ident(), None)
            if process_wide:
                cell, self.cell = self.cell, None
                if cell is not None:
                    cap = cell.capture
        return cap

    def flush_all(self) -> None:
        with self.lock:
            caps = list(self.active.values())
            if self.background is not None:
                caps.append(self.background)
        for cap in caps:
            cap.flush()


router = _Router()


def set_background(cap: Capture | None) -> None:
    """Where a worker process's output outside any cell goes (to the group's leader)."""
    with router.lock:
        router.background = cap


LINE_WAIT = 0.1  # seconds a worker's lines wait for a line another thread is writing


class RoutingStream:
    """Stands in for sys.stdout/stderr: writes go to the current capture.

    Writes that stay in this process also keep lines whole: ``print`` writes its text and
    its newline in two calls, and a worker's lines (``write_lines``) that arrive between
    them would land inside the line. So ``write_lines`` waits, at most ``LINE_WAIT`` after
    another thread began a line, for that line's end."""

    def __init__(self, original: Any, name: str) -> None:
        self._original = original
        self._name = name
        self._line = threading.Condition(threading.RLock())
        self._open: tuple[int, float] | None = None  # (thread, when) of an unfinished line

    def write(self, text: str) -> int:
        widgets = router.local.widget_outputs
        if widgets:  # inside `with output_widget:` on a worker
            _append_to_widget(widgets[-1], self._name, text)
            return len(text)
        cap = router.current()
        if cap is None:
            return self._write_here(text)
        cap.write(self._name, text)
        if cap is router.background:
            self._write_here(text)
        return len(text)

    def _write_here(self, text: str) -> int:
        with self._line:
            n = self._original.write(text)
            if text:
                if text.endswith("\n"):
                    self._open = None
                    self._line.notify_all()
                elif self._open is None or self._open[0] != threading.get_ident():
                    self._open = (threading.get_ident(), time.monotonic())
            return n

    def write_lines(self, text: str) -> int:
        """Writes ``text`` (another member's output) where no other thread's line is open."""
        me = threading.get_ident()
        with self._line:
            while self._open is not None and self._open[0] != me:
                left = self._open[1] + LINE_WAIT - time.monotonic()
                if left <= 0:
                    break  # a line left open (a progress bar): do not wait for it again
                self._line.wait(left)
            return self.write(text)

    def flush(self) -> None:
        try:
            self._original.flush()
        except Exception:
            pass

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._original, attr)


def _append_to_widget(widget: Any, name: str, text: str) -> None:
    """``text`` at the end of an ``ipywidgets.Output``'s outputs, joined to its last
    stream output of the same name (``print`` writes in several pieces)."""
    outs = widget.outputs
    if outs and outs[-1].get("output_type") == "stream" and outs[-1].get("name") == name:
        widget.outputs = outs[:-1] + ({**outs[-1], "text": outs[-1]["text"] + text},)
    else:
        widget.outputs = outs + ({"output_type": "stream", "name": name, "text": text},)


class RoutingDisplayPublisher:
    """Wraps IPython's display publisher so ``display()`` in a remote cell reaches the caller."""

    def __init__(self, original: Any) -> None:
        self._original = original

    def publish(self, data: Any, metadata: Any = None, source: Any = None, *,
                transient: Any = None, update: bool = False, **kwargs: Any) -> None:
        widgets = router.local.widget_outputs
        if widgets:  # inside `with output_widget:` on a worker
            widgets[-1].outputs += ({"output_type": "display_data", "data": data,
                                     "metadata": metadata or {}},)
            return
        cap = router.current()
        if cap is None or cap is router.background:
            self._original.publish(data, metadata=metadata, transient=transient,
                                   update=update, **kwargs)
            return
        cap.display("display", {"data": data, "metadata": metadata or {},
                                "transient": transient or {}, "update": update})

    def clear_output(self, wait: bool = False) -> None:
        widgets = router.local.widget_outputs
        if widgets:
            widgets[-1].outputs = ()
            return
        cap = router.current()
        if cap is None or cap is router.background:
            self._original.clear_output(wait)
            return
        cap.display("clear", {"wait": wait})

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._original, attr)


def capture_call(func: Any, sender: str) -> Any:
    """``func`` (a plain Python function another member called here), running with its
    output captured for ``sender`` and delivered before the call returns, so it lands in
    the cell that made the call, and in time (output it leaves to other threads goes to
    the process's background capture). In a worker process only: a kernel's output is
    its own notebook's. One wrapper per function and caller, kept (it sits on every call)."""
    s = state.active()
    if s is None or s.runner is None or not s.runner.on_main:
        # a kernel: what it prints is already in its own notebook's running cell
        return func
    try:
        return _wrapper(func, sender, s.name, s.token)
    except TypeError:  # a callable object that cannot be hashed
        return _capturing(func, (None, sender, s.name, s.token))


# functions sent by value arrive as new objects each time: the least recently used go
@functools.lru_cache(maxsize=256)
def _wrapper(func: Any, sender: str, me: str, token: str) -> Any:
    return _capturing(func, (None, sender, me, token))


def _capturing(func: Any, pending: tuple[None, str, str, str]) -> Any:
    local = router.local

    def run(*args: Any, **kwargs: Any) -> Any:
        # the capture is made at the first write: most calls print nothing
        local.pending = pending
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            if router.on_call_failure is not None:  # kept for %debug (rpcnb.cells.console)
                router.on_call_failure(exc, getattr(func, "__qualname__", repr(func)))
            # what torch's _run_function makes of it, without rpcnb's frames: the caller
            # raises its type with this message
            from torch.distributed.rpc import internal

            report = sendable(exc, func, pending[2])
            text = f"{exc!r}\n{user_traceback(exc)}" if report is exc else f"{report!r}\n"
            said = f"On {rpc_me()}:\n{text}"
            print(said, file=sys.stderr)  # as torch does: the callee logs it (its tests check)
            return internal.RemoteException(said, type(report))
        finally:
            if local.capture is None:  # it wrote nothing (most calls)
                local.pending = None
            else:
                cap = router.leave(process_wide=False)
                if cap is not None:
                    cap.close()

    return run


def _flusher() -> None:
    while True:
        time.sleep(FLUSH_INTERVAL)
        router.flush_all()


def install_routing(shell: Any) -> None:
    """Route this process's stdout, stderr and display output through captures (once)."""
    with router.lock:
        if router.installed:
            return
        router.installed = True
    sys.stdout = RoutingStream(sys.stdout, "stdout")
    sys.stderr = RoutingStream(sys.stderr, "stderr")
    if shell is not None and not isinstance(shell.display_pub, RoutingDisplayPublisher):
        shell.display_pub = RoutingDisplayPublisher(shell.display_pub)
    threading.Thread(target=_flusher, name="rpcnb-output", daemon=True).start()


def shell() -> Any:
    """The IPython shell of this process, or None (a plain script)."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is a dependency
        return None
    return get_ipython()
