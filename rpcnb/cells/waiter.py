"""The caller's wait for a remote cell, as an object: ``Sent`` is the cell's calls (one
``Call`` per worker) and their inbox; ``Waiter`` follows them until every call has ended,
printing each worker's output in order as it arrives, asking the user what a worker asks,
and interrupting the workers when the notebook is interrupted, ``timeout`` passes or a
background cell is cancelled; its verdict says which of those ended the wait.

Each message of the inbox (``rpcnb.cells.messages``) goes to one method by its type
(``Waiter.TAKES``); between messages the waiter looks at the calls (``_look``), the
queues the cell may wait in (``console.look_at_queues``) and its limits (``_limits``).
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rpcnb import errors, machine, progress, telemetry, waiting
from rpcnb.cells import comms, console
from rpcnb.cells.messages import Aside, Ask, Done, Gone, Item, Message, Output, stream_chars
from rpcnb.cells.output import LARGE_OUTPUT
from rpcnb.cells.printer import Printer
from rpcnb.cells.runner import NOT_STARTED
from rpcnb.errors import RemoteError, WorkerDiedError, WorkerUnreachableError
from rpcnb.session import protocol
from rpcnb.session.state import Session

INTERRUPT_GRACE = 3.0  # seconds a cell gets to stop after an interrupt
TURN = 0.05  # seconds the waiter waits for a message before it looks around
DRAIN_S = 2.0  # seconds a batch still missing after the result gets (its delivery timed out)
STOPPED_NOTICE = (
    "rpcnb: {name} (pid {pid}) is stopped (SIGSTOP or a debugger), so the cell waits: "
    "`kill -CONT {pid}` resumes it; interrupt the kernel to give up."
)


@dataclass
class Call:
    """One remote cell this process waits for, on one worker."""

    call_id: str
    worker: str
    inbox: queue.SimpleQueue[Message]
    future: Any = None
    next_seq: int = 0
    held: dict[int, list[Item]] = field(default_factory=dict)  # batches that came early
    result: Any = None
    error: BaseException | None = None
    done: bool = False
    outputs: int = 0  # output batches the worker sent before its result
    profile: dict[str, Any] | None = None  # with --profile: the worker's table and trace
    ran: float = 0.0  # seconds the cell's code ran on the worker (its result's duration)
    warned: bool = False
    started: float = field(default_factory=time.monotonic)
    position: Any = None  # the answer to "does it still wait in the queue?", while asked

    def gone(self) -> None:
        """Its worker died, left or stopped answering (the session says): wake the waiter."""
        self.inbox.put(Gone(self.worker))

    def ask(self, question: Any) -> None:
        """Its worker asks for a line of input (``rpcnb.cells.console.route``)."""
        self.inbox.put(Ask(question))

    def read_result(self) -> None:
        """Its future has completed: take the result, or the error, it holds."""
        self.done = True
        try:
            res = self.future.wait()
        except Exception as exc:
            self.error = exc  # a transport error: the waiter says what it means
            return
        if type(res) is tuple:  # it ran; no value, or one fetched (CellResult.wire)
            self.ran, self.outputs = res[0], res[1]
            self.result = res[2] if len(res) == 3 else None
            return
        self.outputs = res.outputs
        self.profile = res.profile
        self.ran = float(res.duration or 0.0)
        if res.ok:
            self.result = res.value if res.has_value and res.rref is None else res.rref
        else:
            self.error = RemoteError(res.worker, res.ename, res.evalue, res.traceback)


LOCAL = "local"  # the name of the notebook's own result with ``local=True``


@dataclass
class Sent:
    """The calls of one remote cell, sent: what ``Waiter`` follows and ``outcome`` reads."""

    calls: dict[str, Call]
    inbox: queue.SimpleQueue[Message]
    start: float
    t0: float
    late: list[str] = field(default_factory=list)  # still running when the wait gave up
    transfers: progress.Transfers = field(default_factory=progress.Transfers)
    interrupted: bool = False
    local: tuple[Any, BaseException | None] | None = None  # run here too: (value, error)
    sent_at: float = field(default_factory=time.monotonic)
    told: set[str] = field(default_factory=set)  # workers already said to be busy
    looked: bool = False  # every worker was asked whether the cell waits in its queue
    # interrupt() is called by the waiting thread and by a background cell's cancel()
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def forget(self, s: Session) -> None:
        """Stop routing output to these calls, and keep their timings."""
        s.forget_calls(self.calls)
        elapsed = time.perf_counter() - self.t0
        for call in self.calls.values():
            # the cell's own run on the worker is not latency: kept apart (telemetry.Record.ran)
            telemetry.record(call.worker, "cell", self.start, elapsed, ok=call.error is None,
                             ran=min(call.ran, elapsed))

    def interrupt(self, s: Session) -> None:
        """Interrupt the cell on every worker still running it (or drop it from their
        queues); once, whoever asks first (the waiting thread, or ``cancel()`` at once)."""
        with self._lock:
            if self.interrupted:
                return
            self.interrupted = True
        for c in self.calls.values():
            if not c.done and not s.is_dead(c.worker):
                try:
                    protocol.call_async(s.token, c.worker, "interrupt", c.call_id, timeout=5)
                except Exception:
                    pass

    def outcome(self, many: bool) -> Any:
        """The result (see ``rpcnb.cells.call.run``), or the error to raise."""
        if not many:  # one worker, nothing run here (most cells)
            call = next(iter(self.calls.values()))
            if call.error is None:
                return call.result
        failures = {c.worker: c.error for c in self.calls.values() if c.error is not None}
        if self.local is not None and self.local[1] is not None:
            failures[LOCAL] = self.local[1]
        if failures:
            raise self._error(failures, many)
        results = {c.worker: c.result for c in self.calls.values()}
        if self.local is not None:
            results[LOCAL] = self.local[0]
        if many:
            # statements only (no value anywhere): show nothing, as a single cell would
            return results if any(r is not None for r in results.values()) else None
        return next(iter(results.values()))

    def _error(self, failures: dict[str, BaseException], many: bool) -> BaseException:
        remote = {w: e for w, e in failures.items() if isinstance(e, RemoteError)}
        other = [e for e in failures.values() if not isinstance(e, RemoteError)]
        if other:
            exc: BaseException = other[0]
        elif len(remote) == 1:
            exc = next(iter(remote.values()))
        else:
            exc = errors.CompositeRemoteError(remote)
        if many and isinstance(exc, errors.RpcnbError):  # nothing the others did is lost
            exc.results = {c.worker: c.result for c in self.calls.values()
                           if c.done and c.error is None} or None
        return exc


class Cancelled(Exception):
    """A background cell was cancelled; ``late``: the workers still running it."""

    def __init__(self, late: list[str] | None = None) -> None:
        self.late = list(late or [])
        super().__init__(errors.CANCELLED_RUNNING.format(name=", ".join(self.late))
                         if self.late else errors.CANCELLED)


class Waiter:
    """Follows a sent cell until every call has ended (see the module's docstring).

    ``prefix``: several workers (or the notebook too) print, so each line is marked with
    its worker. ``cancel``: set by a background cell's ``cancel()``."""

    def __init__(self, s: Session, sent: Sent, timeout: float | None, prefix: bool,
                 cancel: threading.Event | None = None) -> None:
        self.s = s
        self.sent = sent
        self.calls = sent.calls
        self.timeout = timeout
        self.deadline = waiting.Deadline.after(timeout)
        self.cancel = cancel
        self.printer = Printer(prefix, on_comm=comms.relay)
        # not a method of the waiter: a cycle through it would keep the cell's results
        # (a fetched tensor) alive until the garbage collector runs
        self.printer.on_progress = functools.partial(_transfer, sent.transfers)
        self.interrupted_at: float | None = None  # when the waiter interrupted the workers
        self.reason: BaseException | None = None  # what made it: an interrupt, the time...
        self.large = False  # a large batch went through: give memory back at the end
        # only a notebook's own cell can ask its user: not a background cell's thread
        self.here = threading.current_thread() is threading.main_thread()

    def run(self) -> None:
        """Wait until every call has ended (or was given up on), then raise what ended
        the wait early: KeyboardInterrupt, TimeoutError or ``Cancelled``."""
        try:
            self._follow()
        finally:
            self._close()
        self.sent.late = [c.worker for c in self.calls.values() if not c.done]
        self._verdict()

    # -- the loop
    def _follow(self) -> None:
        while True:
            try:
                if self._turn():
                    return
            except KeyboardInterrupt:
                if self.interrupted_at is not None:
                    raise
                self._give_up(KeyboardInterrupt())

    def _turn(self) -> bool:
        """One message (if one comes within ``TURN``), then a look around; True once the
        wait is over."""
        try:
            self.take(self.sent.inbox.get(timeout=TURN))
        except queue.Empty:
            pass
        if not self._look():
            self._drain()
            return True
        now = time.monotonic()
        if self.here and not self.sent.looked:  # a background cell's queue: its handle's
            self.sent.looked = console.look_at_queues(self.s, self.calls, self.sent.told,
                                                      now - self.sent.sent_at)
        if self.interrupted_at is not None:
            return now - self.interrupted_at > INTERRUPT_GRACE
        self._limits()
        return False

    def _limits(self) -> None:
        """Interrupt the workers once the cell is cancelled or its time is up."""
        if self.cancel is not None and self.cancel.is_set():
            self._give_up(Cancelled())
        elif self.deadline.passed():
            self._give_up(TimeoutError())

    def _give_up(self, reason: BaseException) -> None:
        self.reason = reason
        self.interrupted_at = time.monotonic()
        self.sent.interrupt(self.s)

    def _drain(self) -> None:
        """Every batch was delivered before its cell's result was sent, so it is in the
        inbox by now; a batch still missing (its delivery timed out) gets ``DRAIN_S`` more."""
        inbox = self.sent.inbox
        late = waiting.Deadline.after(DRAIN_S)
        while True:
            if not inbox.empty():  # this thread alone takes from it: the get cannot wait
                self.take(inbox.get_nowait())
                continue
            if all(c.next_seq >= c.outputs for c in self.calls.values()) or late.passed():
                return
            try:
                self.take(inbox.get(timeout=TURN))
            except queue.Empty:
                pass

    # -- the messages, by type
    def take(self, msg: Message) -> None:
        self.TAKES[type(msg)](self, msg)

    def _output(self, msg: Output) -> None:
        call = self.calls.get(msg.call_id)
        if call is None:
            return
        call.held[msg.seq] = msg.items
        while call.next_seq in call.held:
            batch = call.held.pop(call.next_seq)
            self.printer.show(msg.worker, batch)
            call.next_seq += 1
            self.large = self.large or stream_chars(batch) >= LARGE_OUTPUT

    def _aside(self, msg: Aside) -> None:
        if msg.call_id in self.calls:
            self.printer.show(msg.worker, msg.items)

    def _ask(self, msg: Ask) -> None:  # a worker asks for input (rpcnb.cells.console)
        console.take(msg.question, self.here, self.interrupted_at is not None,
                     self.printer.finish)

    def _wake(self, msg: Done | Gone) -> None:
        """Nothing to show: the look that follows every message reads the call."""

    TAKES: ClassVar[dict[type, Callable[[Waiter, Any], None]]] = {
        Output: _output, Aside: _aside, Ask: _ask, Done: _wake, Gone: _wake}

    # -- the calls
    def _look(self) -> bool:
        """Finish the calls that have ended; whether any is still pending."""
        pending = False
        for call in self.calls.values():
            if not call.done:
                self._look_at(call)
                pending = pending or not call.done
        return pending

    def _look_at(self, call: Call) -> None:
        """Finish ``call`` if its future is done or its worker is known dead or unreachable."""
        s = self.s
        if call.future.done():
            call.read_result()
            if call.error is not None and not isinstance(call.error, RemoteError):
                call.error = failure(s, call.worker, call.error)
            return
        proc = s.procs.get(call.worker)
        if proc is not None and not call.warned and time.monotonic() - call.started > 1.0 \
                and proc.stopped():
            call.warned = True
            print(STOPPED_NOTICE.format(name=call.worker, pid=proc.pid), file=sys.stderr)
        if s.is_dead(call.worker):
            call.done = True
            call.error = WorkerDiedError(s.death_message(call.worker), call.worker)
        elif s.is_unreachable(call.worker):
            call.done = True
            call.error = WorkerUnreachableError(s.unreachable_message(call.worker), call.worker)

    # -- the end
    def _close(self) -> None:
        sent = self.sent
        if sent.transfers.open:
            sent.transfers.close(ok=all(c.done and c.error is None for c in self.calls.values()))
        self.printer.finish()
        if self.large:  # printed and flushed: give the memory back (docs: load)
            machine.give_back_memory()

    def _verdict(self) -> None:
        """Raise what ended the wait early, if anything did."""
        reason, calls = self.reason, self.calls.values()
        if reason is None and self.cancel is None:  # it ended by itself (most cells)
            return
        if reason is None and self.cancel is not None and self.cancel.is_set() and any(
                isinstance(c.error, RemoteError) and c.error.ename == "KeyboardInterrupt"
                for c in calls):
            reason = Cancelled()  # cancel() interrupted it before this thread looked
        late = self.sent.late
        if isinstance(reason, KeyboardInterrupt):
            console.interrupted(late, [c.worker for c in calls if isinstance(
                c.error, RemoteError) and c.error.evalue == NOT_STARTED])
        if isinstance(reason, Cancelled):
            raise Cancelled(late)
        if isinstance(reason, TimeoutError):
            stopped = [c.worker for c in calls if c.done and isinstance(c.error, RemoteError)
                       and c.error.ename == "KeyboardInterrupt"]
            if late:
                raise TimeoutError(errors.CALL_TIMEOUT_RUNNING.format(
                    name=", ".join(late), timeout=self.timeout, grace=INTERRUPT_GRACE,
                    first=late[0]))
            if stopped:
                raise TimeoutError(errors.CALL_TIMEOUT.format(name=", ".join(stopped),
                                                              timeout=self.timeout))


def _transfer(transfers: progress.Transfers, payload: dict[str, Any]) -> None:
    """A ``--fetch``'s stage, as the worker tells it: its bar starts or ends."""
    worker = str(payload.get("worker", ""))
    if payload.get("stage") == "received":
        transfers.end(worker)
    elif payload.get("stage") == "sending":
        transfers.start(worker, f"--fetch from {worker}:", int(payload["bytes"]))


def wait(s: Session, sent: Sent, timeout: float | None, prefix: bool,
         cancel: threading.Event | None = None) -> None:
    """Follow ``sent`` until every call has ended (``Waiter``)."""
    Waiter(s, sent, timeout, prefix, cancel).run()


def failure(s: Session, worker: str, exc: BaseException) -> BaseException:
    """Turn a transport error into 'worker X died (how)' when that is what happened."""
    proc = s.procs.get(worker)
    if proc is not None and not proc.left:
        # the watcher notices the exit within a fraction of a second, and cleans up
        waiting.until(lambda: s.is_dead(worker), 3.0)
    if s.is_dead(worker):
        return WorkerDiedError(s.death_message(worker), worker)
    if s.is_unreachable(worker):
        return WorkerUnreachableError(s.unreachable_message(worker), worker)
    return WorkerDiedError(f"The call to {worker!r} failed: {exc}", worker)
