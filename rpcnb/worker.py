"""The worker side: namespaces, remote cell execution, output capture, cancellation.

Every member of a group (a started worker process or a joined kernel) has one
``CellRunner``. Remote cells queue on it and run one at a time in the member's namespace,
like cells in a kernel. Their stdout, stderr and display output go back to the caller in
small batches while the cell runs. In a worker process the runner owns the main thread, so
an interrupt is a plain SIGINT; in a kernel it runs on its own thread and an interrupt is
an asynchronous exception.

``main()`` makes a fresh Python a worker process (see ``launch``).
"""

from __future__ import annotations

import ast
import ctypes
import linecache
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.rpc as rpc

from rpcnb import errors

FLUSH_INTERVAL = 0.05  # seconds between output batches while a cell runs
_MAX_PREVIEW = 400


# --------------------------------------------------------------------------- results


@dataclass
class CellResult:
    """What a remote cell sends back: an RRef, a value, or an error, never raised."""

    worker: str
    ok: bool
    rref: Any = None  # rpc.RRef owned by the worker, or None
    value: Any = None  # with --fetch
    has_value: bool = False
    ename: str = ""
    evalue: str = ""
    traceback: str = ""
    duration: float = 0.0
    outputs: int = 0  # number of output batches sent before this result


def describe(value: Any) -> dict[str, Any]:
    """A short, display-ready description of a value (runs where the value lives)."""
    cls = type(value)
    mod = cls.__module__
    tname = cls.__qualname__ if mod in ("builtins", "__main__") else f"{mod}.{cls.__qualname__}"
    info: dict[str, Any] = {"type": tname}
    if isinstance(value, torch.Tensor):
        info.update(
            shape=list(value.shape),
            dtype=str(value.dtype).replace("torch.", ""),
            device=str(value.device),
            nbytes=value.element_size() * value.nelement(),
            requires_grad=bool(value.requires_grad),
        )
        from torch._tensor_str import printoptions

        with printoptions(threshold=24, edgeitems=2, precision=4, linewidth=72):
            preview = repr(value.detach())
    else:
        try:
            preview = repr(value)
        except Exception as exc:  # a broken __repr__ must not break the display
            preview = f"<repr failed: {exc!r}>"
        if hasattr(value, "__len__"):
            try:
                info["len"] = len(value)
            except Exception:
                pass
    if len(preview) > _MAX_PREVIEW:
        preview = preview[: _MAX_PREVIEW - 3] + "..."
    info["preview"] = preview
    return info


# --------------------------------------------------------------------------- capture


class Capture:
    """Output of one remote cell, batched and sent to the caller as it arrives."""

    def __init__(self, call_id: str | None, caller: str, worker: str, token: str) -> None:
        self.call_id = call_id
        self.token = token
        self.caller = caller
        self.worker = worker
        self._lock = threading.Lock()
        self._items: list[tuple[Any, ...]] = []
        self._seq = 0
        self._futures: list[Any] = []

    def write(self, stream: str, text: str) -> None:
        if not text:
            return
        with self._lock:
            if self._items and self._items[-1][0] == stream:
                self._items[-1] = (stream, self._items[-1][1] + text)
            else:
                self._items.append((stream, text))

    def display(self, kind: str, payload: dict[str, Any]) -> None:
        with self._lock:
            self._items.append((kind, payload))
        self.flush()

    def flush(self) -> None:
        with self._lock:
            if not self._items:
                return
            items, self._items = self._items, []
            seq = self._seq
            self._seq += 1
        from rpcnb import session

        try:
            fut = rpc.rpc_async(
                self.caller, session._deliver,
                args=(self.token, self.call_id, self.worker, seq, items),
            )
        except Exception:
            return  # the caller is gone; nobody is left to show this output
        with self._lock:
            self._futures.append(fut)

    def close(self, timeout: float = 10.0) -> int:
        """Send what is left, wait until the caller has it; returns the batch count."""
        self.flush()
        deadline = time.monotonic() + timeout
        for fut in self._futures:
            while not fut.done() and time.monotonic() < deadline:
                time.sleep(0.001)
        return self._seq


_local = threading.local()
_active: dict[int, Capture] = {}  # thread id -> capture, for the flusher
_active_lock = threading.Lock()
_process_capture: Capture | None = None  # in a worker process: the running cell's
_background: Capture | None = None  # in a worker process: output outside any cell


def _current() -> Capture | None:
    cap = getattr(_local, "capture", None)
    if cap is not None:
        return cap
    return _process_capture or _background


class RoutingStream:
    """Stands in for sys.stdout/stderr: writes go to the current thread's capture."""

    def __init__(self, original: Any, name: str) -> None:
        self._original = original
        self._name = name

    def write(self, text: str) -> int:
        cap = _current()
        if cap is None:
            return self._original.write(text)
        cap.write(self._name, text)
        if cap is _background:
            self._original.write(text)
        return len(text)

    def flush(self) -> None:
        try:
            self._original.flush()
        except Exception:
            pass

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._original, attr)


class RoutingDisplayPublisher:
    """Wraps IPython's display publisher so ``display()`` in a remote cell reaches the caller."""

    def __init__(self, original: Any) -> None:
        self._original = original

    def publish(self, data: Any, metadata: Any = None, source: Any = None, *,
                transient: Any = None, update: bool = False, **kwargs: Any) -> None:
        cap = _current()
        if cap is None or cap is _background:
            self._original.publish(data, metadata=metadata, transient=transient,
                                   update=update, **kwargs)
            return
        cap.display("display", {"data": data, "metadata": metadata or {},
                                "transient": transient or {}, "update": update})

    def clear_output(self, wait: bool = False) -> None:
        cap = _current()
        if cap is None or cap is _background:
            self._original.clear_output(wait)
            return
        cap.display("clear", {"wait": wait})

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._original, attr)


def _flusher() -> None:
    while True:
        time.sleep(FLUSH_INTERVAL)
        with _active_lock:
            caps = list(_active.values())
        if _background is not None:
            caps.append(_background)
        for cap in caps:
            cap.flush()


_routing_installed = False


def install_routing(shell: Any) -> None:
    """Route this process's stdout, stderr and display output through captures (once)."""
    global _routing_installed
    if _routing_installed:
        return
    sys.stdout = RoutingStream(sys.stdout, "stdout")
    sys.stderr = RoutingStream(sys.stderr, "stderr")
    if shell is not None and not isinstance(shell.display_pub, RoutingDisplayPublisher):
        shell.display_pub = RoutingDisplayPublisher(shell.display_pub)
    threading.Thread(target=_flusher, name="rpcnb-output", daemon=True).start()
    _routing_installed = True


# --------------------------------------------------------------------------- runner


@dataclass
class _Job:
    token: str
    call_id: str
    caller: str
    source: str
    fetch: bool
    push: dict[str, Any]
    future: Any
    filename: str = ""
    started: float = field(default_factory=time.monotonic)


class CellRunner:
    """Runs remote cells one at a time in ``namespace``."""

    def __init__(self, name: str, namespace: dict[str, Any], shell: Any = None) -> None:
        self.name = name
        self.namespace = namespace
        self.shell = shell
        self.cells_run = 0
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._current: _Job | None = None
        self._thread_id: int | None = None
        self._on_main = False
        self._stopped = threading.Event()
        self._cancelled: set[str] = set()

    # -- called from RPC threads
    def submit(self, job: _Job) -> None:
        self._queue.put(job)

    def interrupt(self, call_id: str) -> bool:
        with self._lock:
            job = self._current
            if job is None or job.call_id != call_id or self._thread_id is None:
                # Not running yet: drop it from the queue by marking it cancelled.
                self._cancelled.add(call_id)
                return False
            if self._on_main:
                signal.pthread_kill(self._thread_id, signal.SIGINT)
            else:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._thread_id), ctypes.py_object(KeyboardInterrupt)
                )
            return True

    def stop(self) -> None:
        self._stopped.set()
        self._queue.put(None)

    # -- the loop
    def run_forever(self, on_main: bool = False) -> None:
        self._on_main = on_main
        self._thread_id = threading.get_ident()
        while not self._stopped.is_set():
            try:
                job = self._queue.get()
            except KeyboardInterrupt:
                continue  # an interrupt that arrived after its cell ended
            if job is None:
                break
            try:
                self._run(job)
            except KeyboardInterrupt:
                continue

    def start_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.run_forever, name=f"rpcnb-cells-{self.name}", daemon=True)
        t.start()
        return t

    def _run(self, job: _Job) -> None:
        global _process_capture
        if job.call_id in self._cancelled:
            self._cancelled.discard(job.call_id)
            job.future.set_result(CellResult(self.name, False, ename="KeyboardInterrupt",
                                             evalue="interrupted before it started"))
            return
        self.cells_run += 1
        job.filename = f"<{self.name} cell {self.cells_run}>"
        cap = Capture(job.call_id, job.caller, self.name, job.token)
        _local.capture = cap
        tid = threading.get_ident()
        with _active_lock:
            _active[tid] = cap
        if self._on_main:
            _process_capture = cap
        t0 = time.perf_counter()
        try:
            with self._lock:
                self._current = job
            try:
                result = self._execute(job)
            finally:
                with self._lock:
                    self._current = None
        except BaseException as exc:  # KeyboardInterrupt included: the worker lives on
            result = CellResult(self.name, False, ename=type(exc).__name__, evalue=str(exc),
                                traceback=_format_exception(exc, job.filename))
        finally:
            _local.capture = None
            if self._on_main:
                _process_capture = None
            with _active_lock:
                _active.pop(tid, None)
        result.duration = time.perf_counter() - t0
        try:
            result.outputs = cap.close()
        except KeyboardInterrupt:
            result.outputs = cap.close()
        job.future.set_result(result)

    def _execute(self, job: _Job) -> CellResult:
        ns = self.namespace
        ns.update(job.push)
        value, has_value = run_source(job.source, job.filename, ns, self.shell)
        if not has_value or value is None:
            return CellResult(self.name, True)
        if job.fetch:
            from torch.distributed.rpc.internal import _internal_rpc_pickler

            from rpcnb import shm

            try:
                with shm.suppressed():  # a dry run: no buffer taken
                    _internal_rpc_pickler.serialize(value)
            except Exception as exc:
                return CellResult(
                    self.name, False, ename=type(exc).__name__,
                    evalue=errors.NOT_PICKLABLE.format(
                        name=self.name, type=type(value).__name__, reason=exc),
                )
            return CellResult(self.name, True, value=value, has_value=True)
        return CellResult(self.name, True, rref=_make_rref(self.name, value), has_value=True)


_parked: dict[str, Any] = {}


def _unpark(key: str) -> Any:
    return _parked.pop(key)


def _make_rref(me: str, value: Any) -> Any:
    """An RRef owned here. A tensor RRef made by rpc.RRef() is fetched by TorchScript's
    pickler, which rpcnb cannot route; a large CPU tensor is wrapped in a Python-object
    RRef instead (made by a remote call to ourselves) so that ``to_here()`` takes the
    shared-memory path."""
    from rpcnb import shm

    if isinstance(value, torch.Tensor) and shm.wants(value):
        key = os.urandom(8).hex()
        _parked[key] = value
        return rpc.remote(me, _unpark, args=(key,))
    return rpc.RRef(value)


def run_source(source: str, filename: str, ns: dict[str, Any], shell: Any = None) -> tuple[Any, bool]:
    """Execute a cell; return (value of the last expression, whether there was one)."""
    if shell is not None:
        source = shell.transform_cell(source)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    tree = ast.parse(source, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
        expr = tree.body.pop()
        assert isinstance(expr, ast.Expr)
        last = ast.Expression(expr.value)
    exec(compile(tree, filename, "exec"), ns)
    if last is None:
        return None, False
    return eval(compile(last, filename, "eval"), ns), True


def _format_exception(exc: BaseException, filename: str) -> str:
    """The traceback from the cell's own frames on (rpcnb's frames dropped)."""
    te = traceback.TracebackException.from_exception(exc)
    frames = list(te.stack)
    for i, fr in enumerate(frames):
        if fr.filename == filename:
            te.stack = traceback.StackSummary.from_list(frames[i:])
            break
    else:
        te.stack = traceback.StackSummary.from_list([])
    return "".join(te.format())


# --------------------------------------------------------------------------- RPC targets

_runner: CellRunner | None = None
_leave_hook: Any = None


def _get_runner() -> CellRunner:
    if _runner is None:
        raise RuntimeError("rpcnb: this member has no cell runner")
    return _runner


def _verify(token: str) -> None:
    from rpcnb import session

    session.verified(token)


@rpc.functions.async_execution
def _run_cell(token: str, call_id: str, caller: str, source: str, fetch: bool,
              push: dict[str, Any]) -> torch.futures.Future:
    _verify(token)
    fut: torch.futures.Future = torch.futures.Future()
    _get_runner().submit(_Job(token, call_id, caller, source, fetch, push, fut))
    return fut


def _interrupt(token: str, call_id: str) -> bool:
    _verify(token)
    return _get_runner().interrupt(call_id)


def _describe_rref(token: str, rref: Any) -> dict[str, Any]:
    _verify(token)
    return describe(rref.local_value())


def _describe_self(token: str) -> dict[str, Any]:
    _verify(token)
    return self_info()


def self_info() -> dict[str, Any]:
    """This member's pid, host, kind and devices."""
    runner = _runner
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "kind": "process" if (runner is not None and runner._on_main) else "kernel",
        "devices": [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
        "cells": runner.cells_run if runner is not None else 0,
        "torch": torch.__version__,
    }


def _leave(token: str) -> bool:
    """Asked by the group's first kernel: leave the group, then (process) exit."""
    _verify(token)
    if _leave_hook is None:
        return False
    threading.Thread(target=_leave_hook, name="rpcnb-leave", daemon=True).start()
    return True


# --------------------------------------------------------------------------- process


def _watch_parent(parent_pid: int) -> None:
    """A worker process never outlives the kernel that started it."""
    from rpcnb import shm

    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            # The kernel died: take its shared memory with ours, nobody else will.
            shm.deactivate()
            shm.remove_segments_of(parent_pid)
            os._exit(3)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from rpcnb import serialize, session

    ap = argparse.ArgumentParser(prog="rpcnb.worker")
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--leader", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--options", default="{}", help="JSON of TensorPipe options")
    args = ap.parse_args(argv)

    import json

    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    serialize.install()

    global _runner, _background, _leave_hook
    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    shell = _make_shell(ns)
    _runner = CellRunner(args.name, ns, shell)
    _runner._on_main = True  # it will own the main thread (and says "process" from now on)
    install_routing(shell)
    done = threading.Event()

    def leave() -> None:
        try:
            session.leave_group(timeout=10.0)
        finally:
            done.set()
            _get_runner().stop()

    _leave_hook = leave
    secret = os.environ.pop("RPCNB_SECRET", "")
    s = session.start_member(args.name, args.rank, args.init_method, json.loads(args.options),
                             leader=args.leader, runner=_runner, secret=secret)
    _background = Capture(None, args.leader, args.name, s.token)
    _runner.run_forever(on_main=True)
    done.wait(15)
    sys.stdout.flush()
    os._exit(0)


def _make_shell(ns: dict[str, Any]) -> Any:
    """A headless IPython shell, so remote cells get display(), magics and get_ipython()."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    class WorkerShell(InteractiveShell):
        def enable_gui(self, gui: str | None = None) -> None:
            # %matplotlib inline needs no event loop; a worker has no screen for others.
            if gui not in (None, "inline"):
                raise RuntimeError(f"A worker has no screen for the {gui!r} GUI: use "
                                   "%matplotlib inline, figures show in the calling cell.")

    cfg = Config()
    cfg.HistoryManager.enabled = False
    return WorkerShell.instance(config=cfg, user_ns=ns)


