"""The caller's side of a remote cell: send it to one or more workers, print their output
into this cell as it arrives (in order), turn their results into RRefs, values or
errors, and interrupt them when the notebook is interrupted or ``timeout`` passes.
"""

from __future__ import annotations

import queue
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rpcnb import errors, machine, protocol, roster, state, telemetry
from rpcnb.cells.output import Printer, large
from rpcnb.errors import RemoteError, WorkerDiedError
from rpcnb.state import Session

INTERRUPT_GRACE = 3.0  # seconds a cell gets to stop after an interrupt
STOPPED_NOTICE = (
    "rpcnb: {name} (pid {pid}) is stopped (SIGSTOP or a debugger), so the cell waits: "
    "`kill -CONT {pid}` resumes it; interrupt the kernel to give up."
)


@dataclass
class Call:
    """One remote cell this process waits for, on one worker."""

    call_id: str
    worker: str
    inbox: queue.Queue[tuple[str, str, int, list[Any]]]
    future: Any = None
    next_seq: int = 0
    held: dict[int, list[Any]] = field(default_factory=dict)
    result: Any = None
    error: BaseException | None = None
    done: bool = False
    outputs: int = 0  # output batches the worker sent before its result
    warned: bool = False
    started: float = field(default_factory=time.monotonic)


def run(target: str | Iterable[str] | None, source: str, *, fetch: bool = False,
        push: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
    """Run ``source`` on the target worker(s) as a cell and wait for it.

    Output streams into this process's stdout/stderr/display while the cell runs. Returns
    an RRef to the last expression's value (None if there is none), the value itself with
    ``fetch=True``, or ``{name: result}`` when several workers (or ``ALL``) are named
    (None when no worker had a value).
    Raises RemoteError (with ``.worker``) for an exception on the worker.
    """
    s = state.current()
    if not isinstance(source, str) or not source.strip():
        raise ValueError(errors.EMPTY_CELL.format(target=target or "the workers"))
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}.")
    names, many = roster.resolve(s, target)

    inbox: queue.Queue[tuple[str, str, int, list[Any]]] = queue.Queue()
    calls: dict[str, Call] = {}
    start = telemetry.now()
    t0 = time.perf_counter()
    try:
        for name in names:
            call = Call(uuid.uuid4().hex, name, inbox)
            with s.lock:
                s.calls[call.call_id] = call
            calls[call.call_id] = call
            try:
                call.future = protocol.call_async(
                    s.token, name, "run_cell", call.call_id, s.name, source, fetch,
                    dict(push or {}), timeout=0)
            except Exception as exc:  # it could not be pickled: nothing was sent
                raise _push_error(push or {}, exc) from exc
            call.future.add_done_callback(
                lambda _f, cid=call.call_id: inbox.put(("__done__", cid, -1, [])))
        _wait(s, calls, inbox, timeout, prefix=many)
    finally:
        with s.lock:
            for cid in calls:
                s.calls.pop(cid, None)
    elapsed = time.perf_counter() - t0
    for call in calls.values():
        telemetry.record(call.worker, "cell", start, elapsed, ok=call.error is None)
    failures = {c.worker: c.error for c in calls.values() if c.error is not None}
    if failures:
        remote = {w: e for w, e in failures.items() if isinstance(e, RemoteError)}
        other = [e for e in failures.values() if not isinstance(e, RemoteError)]
        if other:
            raise other[0]
        if len(remote) == 1:
            raise next(iter(remote.values()))
        raise errors.CompositeRemoteError(remote)
    results = {c.worker: c.result for c in calls.values()}
    if many:
        # statements only (no value anywhere): show nothing, as a single cell would
        return results if any(r is not None for r in results.values()) else None
    return results[names[0]]


def _push_error(push: dict[str, Any], exc: Exception) -> Exception:
    """ValueError naming the --push value that cannot be sent, if that is what failed."""
    from rpcnb import _torch, shm

    for name, value in push.items():
        try:
            with shm.suppressed():  # a dry run: no buffer taken
                _torch.rpc_pickler().serialize(value)
        except Exception as err:
            return ValueError(errors.PUSH_NOT_PICKLABLE.format(
                name=name, type=type(value).__qualname__, reason=err))
    return exc


def deliver(s: Session, call_id: str, worker: str, seq: int, items: list[Any]) -> None:
    """A batch of a remote cell's output arrived: hand it to the call that waits for it."""
    with s.lock:
        call = s.calls.get(call_id)
    if call is not None:
        call.inbox.put((call_id, worker, seq, items))


def _wait(s: Session, calls: dict[str, Call], inbox: queue.Queue[Any],
          timeout: float | None, prefix: bool) -> None:
    printer = Printer(prefix)
    deadline = None if timeout is None else time.monotonic() + timeout
    interrupted_at: float | None = None
    reason: BaseException | None = None

    def render(msg: tuple[str, str, int, list[Any]]) -> None:
        cid, wname, seq, items = msg
        if cid in ("__dead__", "__done__"):
            return
        call = calls.get(cid)
        if call is None:
            return
        call.held[seq] = items
        while call.next_seq in call.held:
            batch = call.held.pop(call.next_seq)
            printer.items(wname, batch)
            call.next_seq += 1
            printer.large = printer.large or large(batch)

    def drain() -> None:
        # Every batch was delivered before its cell's result was sent, so it is in the
        # inbox by now; a batch still missing (its delivery timed out) gets 2 s more.
        late = time.monotonic() + 2
        while True:
            try:
                render(inbox.get_nowait())
                continue
            except queue.Empty:
                pass
            if all(c.next_seq >= c.outputs for c in calls.values()) or time.monotonic() > late:
                return
            try:
                render(inbox.get(timeout=0.05))
            except queue.Empty:
                pass

    def interrupt_all() -> None:
        for c in calls.values():
            if not c.done and c.worker not in s.dead:
                try:
                    protocol.call_async(s.token, c.worker, "interrupt", c.call_id, timeout=5)
                except Exception:
                    pass

    try:
        while True:
            try:
                try:
                    render(inbox.get(timeout=0.05))
                except queue.Empty:
                    pass
                for call in calls.values():
                    if not call.done:
                        _check_call(s, call)
                if all(c.done for c in calls.values()):
                    drain()
                    break
                now = time.monotonic()
                if interrupted_at is not None and now - interrupted_at > INTERRUPT_GRACE:
                    break
                if deadline is not None and now > deadline and interrupted_at is None:
                    reason = TimeoutError()
                    interrupted_at = now
                    interrupt_all()
            except KeyboardInterrupt:
                if interrupted_at is not None:
                    raise
                reason = KeyboardInterrupt()
                interrupted_at = time.monotonic()
                interrupt_all()
    finally:
        printer.finish()
        if printer.large:  # printed and flushed: give the memory back (docs: load)
            machine.give_back_memory(min_interval=0)
    if isinstance(reason, KeyboardInterrupt):
        raise KeyboardInterrupt
    if isinstance(reason, TimeoutError):
        late = [c.worker for c in calls.values()
                if not c.done or (c.error is not None and isinstance(c.error, RemoteError)
                                  and c.error.ename == "KeyboardInterrupt")]
        if late:
            raise TimeoutError(errors.CALL_TIMEOUT.format(name=", ".join(late),
                                                          timeout=timeout))


def _check_call(s: Session, call: Call) -> None:
    """Finish ``call`` if its future is done or its worker is known dead."""
    proc = s.procs.get(call.worker)
    if proc is not None and not call.warned and time.monotonic() - call.started > 1.0 \
            and proc.stopped():
        call.warned = True
        print(STOPPED_NOTICE.format(name=call.worker, pid=proc.pid), file=sys.stderr)
    fut = call.future
    if fut.done():
        call.done = True
        try:
            res = fut.wait()
        except Exception as exc:
            call.error = _call_failure(s, call.worker, exc)
            return
        call.outputs = res.outputs
        if res.ok:
            call.result = res.value if res.has_value and res.rref is None else res.rref
        else:
            call.error = RemoteError(res.worker, res.ename, res.evalue, res.traceback)
        return
    if call.worker in s.dead:
        call.done = True
        call.error = WorkerDiedError(s.death_message(call.worker), call.worker)


def _call_failure(s: Session, worker: str, exc: BaseException) -> BaseException:
    """Turn a transport error into 'worker X died (how)' when that is what happened."""
    proc = s.procs.get(worker)
    if proc is not None and not proc.left:
        # The watcher notices the exit within a fraction of a second, and cleans up.
        deadline = time.monotonic() + 3
        while worker not in s.dead and time.monotonic() < deadline:
            time.sleep(0.02)
    if worker in s.dead:
        return WorkerDiedError(s.death_message(worker), worker)
    return WorkerDiedError(f"The call to {worker!r} failed: {exc}", worker)


def interrupt(worker: str) -> None:
    """Interrupt whatever remote cell ``worker`` is running for this process (the cell
    ends with KeyboardInterrupt; the worker and its namespace stay)."""
    s = state.current()
    with s.lock:
        ids = [c.call_id for c in s.calls.values() if c.worker == worker]
    for cid in ids:
        protocol.call(s.token, worker, "interrupt", cid, timeout=5)
