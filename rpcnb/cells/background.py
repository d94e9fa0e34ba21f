"""Background remote cells (``%%remote WORKER --bg``): sent like any cell, followed by a
thread of their own, so the notebook goes on while they run.

The thread runs in a copy of the starting cell's context: ipykernel keeps the cell a
message belongs to in a context variable, so what the worker prints keeps arriving in the
cell that started it while other cells run. Cells sent later to the same worker queue
behind it there (a worker runs one cell at a time); the handle and the later cell say so.
"""

from __future__ import annotations

import contextvars
import queue
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from rpcnb import errors, progress, telemetry, text
from rpcnb.cells import call, comms, waiter
from rpcnb.cells.messages import Done, Message, from_wire
from rpcnb.cells.printer import Printer
from rpcnb.errors import RpcnbError
from rpcnb.session import members, protocol, state

PROGRESS_INTERVAL = 0.5  # seconds between updates of wait_interactive's display
ASK_S = 1.0  # how long %rpc_jobs waits for a worker to say where its cell is


class BackgroundCell:
    """The handle of a background remote cell: ``ready()``, ``wait(timeout)``,
    ``result()``, ``cancel()``, ``wait_interactive()``; ``status`` says where it is."""

    def __init__(self, job_id: int, workers: list[str], source: str, many: bool,
                 behind: dict[str, list[int]]) -> None:
        self.id = job_id
        self.workers = workers
        self.source = source
        self.many = many
        self.behind = behind  # worker -> ids of the background cells it was sent behind
        self.started = time.monotonic()
        self.ended: float | None = None
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._sent: waiter.Sent | None = None
        # adopted (rpcnb.cells.orphans): the kernel that started it, and what it printed
        # while no kernel was attached
        self.origin = ""
        self.kept: list[Any] = []
        # it had ended before this kernel attached: how ("done", "failed: NameError"), said
        # in the attach's report
        self.kept_ended = ""

    # -- what a user calls
    def ready(self) -> bool:
        """Whether the cell has ended (with a result, an error, or cancelled)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the cell ends, at most ``timeout`` seconds; whether it has ended."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """What the cell gave (an RRef, a value with --fetch, or a dict for several
        workers), once it has ended; its error is raised here."""
        if not self._done.wait(timeout):
            raise TimeoutError(errors.BG_NOT_READY.format(id=self.id, timeout=timeout))
        if self._error is not None:
            raise self._error
        return self._value

    def cancel(self) -> bool:
        """Interrupt the cell on its workers (a queued one is dropped before it starts).
        False if it had ended already."""
        if self._done.is_set():
            return False
        self._cancel.set()
        s = state.active()
        if self._sent is not None and s is not None:
            # at once, not at the following thread's next look: a cell queued behind one
            # that is ending could start (and run) in between
            self._sent.interrupt(s)
        return True

    def wait_interactive(self, interval: float = PROGRESS_INTERVAL,
                         timeout: float | None = None) -> Any:
        """Wait showing progress (workers done, seconds so far), then return ``result()``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        handle = _Progress(self)
        if timeout is not None:
            interval = min(interval, timeout)
        try:
            while not self._done.wait(interval):
                handle.update()
                if deadline is not None and time.monotonic() > deadline:
                    break
        finally:
            handle.update(final=True)
        return self.result(0)

    def error(self) -> BaseException | None:
        """The error the cell ended with, or None."""
        return self._error

    # -- state
    def pending_workers(self) -> list[str]:
        """Workers still running (or queued to run) this cell."""
        sent = self._sent
        if sent is None or self._done.is_set():
            return [] if self._done.is_set() else list(self.workers)
        return [c.worker for c in sent.calls.values() if not c.done]

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def status(self) -> str:
        """'queued behind [1] on worker1', 'running', 'done', 'failed: ZeroDivisionError',
        'cancelled'."""
        if self._done.is_set():
            if self._error is None:
                return "done"
            if isinstance(self._error, waiter.Cancelled):
                return "cancelled" + (f" (still running on {', '.join(self._error.late)})"
                                      if self._error.late else "")
            # a RemoteError says what the cell raised there (ZeroDivisionError, ...)
            return f"failed: {getattr(self._error, 'ename', '') or type(self._error).__name__}"
        waiting = []
        s = state.active()
        jobs = s.jobs() if s is not None else {}
        for worker, ids in self.behind.items():
            left = [f"[{i}]" for i in ids if i in jobs and not jobs[i].ready()]
            if left and worker in self.pending_workers():
                waiting.append(f"{', '.join(left)} on {worker}")
        if waiting:
            return "queued behind " + "; ".join(waiting)
        return "cancelling" if self._cancel.is_set() else "running"

    def line(self) -> str:
        first = next((ln.strip() for ln in self.source.splitlines() if ln.strip()), "")
        return first if len(first) <= 50 else first[:47] + "..."

    def __repr__(self) -> str:
        return (f"<rpcnb background cell [{self.id}] on {', '.join(self.workers)}: "
                f"{self.status}, {self.elapsed:.1f} s>")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self) + "\n  .ready() .wait(timeout) .result() .cancel() "
               ".wait_interactive(); %rpc_jobs lists background cells")

    # -- the thread that follows it
    def output(self) -> None:
        """Print what an adopted cell printed while no kernel was attached (its output
        since went into the cell that attached; a cell of this kernel prints into the cell
        that started it)."""
        if not self.origin:
            print(errors.BG_OUTPUT_HERE.format(id=self.id))
            return
        if not self.kept:
            print(errors.BG_KEPT_NOTHING.format(id=self.id, workers=", ".join(self.workers)))
            return
        printer = Printer(False, on_comm=comms.relay)
        printer.show(self.workers[0], from_wire(self.kept))
        printer.finish()

    def _follow(self, s: state.Session, sent: waiter.Sent, timeout: float | None) -> None:
        try:
            waiter.wait(s, sent, timeout, prefix=self.many or bool(self.origin),
                      cancel=self._cancel)
            self._value = sent.outcome(self.many)
        except BaseException as exc:  # noqa: BLE001 - kept for result(); shown below
            self._error = exc
        finally:
            sent.forget(s)
            if self.ended is None:  # an adopted cell that had ended: when it did
                self.ended = time.monotonic()
            self._done.set()
        if self._error is not None and not (self.origin and self.kept_ended):
            print(f"rpcnb: background cell [{self.id}] on {', '.join(self.workers)} ended: "
                  f"{type(self._error).__name__}: {self._error}", file=sys.stderr)
        _flush()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def start(target: str | Iterable[str] | None, source: str, *, fetch: bool = False,
          push: dict[str, Any] | None = None, timeout: float | None = None,
          zero_copy: bool = True) -> BackgroundCell:
    """Send a cell like ``run`` and return at once with its handle; its output keeps
    streaming into the cell (or terminal) that started it.

    A worker runs one cell at a time: a cell sent later to the same worker waits behind
    this one. ``%%remote --bg``; ``rpcnb.run_bg``.

    Args:
        target: the worker(s), as for ``run``.
        source: the cell's code, as for ``run``.
        fetch: send the last expression's value back instead of an RRef to it.
        push: values to put into the worker's namespace first, by name.
        timeout: interrupt the cell after this many seconds (default: no limit).
        zero_copy: as for ``run``.

    Returns:
        The cell's handle, a ``BackgroundCell`` with ``ready()``, ``wait(timeout)``,
        ``result()`` (what ``run`` would have returned; the cell's error, such as a
        ``RemoteError``, is raised there), ``cancel()``, ``wait_interactive()`` and
        ``status``.

    Raises:
        rpcnb.RpcnbError: this process is in no group; a name that is no worker of the group;
            ``ALL`` in a group without other members.
        rpcnb.WorkerDiedError: a named worker has died or left.
        ValueError: an empty ``source``, a ``timeout`` not above 0, or a ``push`` value
            that cannot be pickled.
    """
    s = state.current()
    names, many = call.prepare(s, target, source, timeout)
    behind = call.background_on(s, names)
    job = BackgroundCell(s.next_job_id(), names, source, many, behind)
    sent = call.send(s, names, source, fetch, push, zero_copy)
    job._sent = sent
    s.add_job(job)
    ctx = contextvars.copy_context()  # the starting cell's: its output goes there
    threading.Thread(target=ctx.run, args=(job._follow, s, sent, timeout),
                     name=f"rpcnb-bg-{job.id}", daemon=True).start()
    return job


def adopt(s: state.Session, timeout: float = ASK_S) -> list[BackgroundCell]:
    """This kernel attached to a kept group: take over the cells whose kernel went away
    while they ran (``rpcnb.cells.orphans``), from every worker at once, as background
    cells of this kernel (``%rpc_jobs`` lists them, ``output()`` prints what they printed
    while no kernel was attached). Those still running print into the calling cell
    from now on, each line marked with its worker."""
    asked = protocol.ask_each(s.token, s.others(), "adopt", s.name, timeout=timeout)
    told = []
    for name, fut in asked.items():
        try:
            told += [(name, rec) for rec in fut.wait()]
        except Exception:  # a member that keeps none (an older rpcnb)
            continue
    ctx = contextvars.copy_context()  # the attaching cell's: their output goes there
    # numbered in the order they began, as the kernel before would have numbered them
    return [_adopted(s, name, rec, ctx) for name, rec in sorted(told, key=lambda t: t[1]["since"])]


def _adopted(s: state.Session, worker: str, rec: dict[str, Any],
             ctx: contextvars.Context) -> BackgroundCell:
    job = BackgroundCell(s.next_job_id(), [worker], rec["source"], False, {})
    job.origin, job.kept = rec["caller"], list(rec["kept"])
    now_wall, now = time.time(), time.monotonic()
    job.started = now - (now_wall - rec["since"])
    if rec["ended"] is not None:
        job.ended, job.kept_ended = now - (now_wall - rec["ended"]), rec["status"]
    cid = rec["call_id"]
    inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
    c = waiter.Call(cid, worker, inbox, next_seq=int(rec["next_seq"]))
    sent = waiter.Sent({cid: c}, inbox, telemetry.now(), time.perf_counter())
    s.add_call(c)  # its output is delivered to it from now on
    s.add_job(job)
    job._sent = sent
    try:
        c.future = protocol.call_async(s.token, worker, "orphan_result", cid, s.name,
                                       timeout=None)
    except Exception as exc:
        c.future = _failed(exc)
    c.future.add_done_callback(lambda _: inbox.put(Done(cid)))
    threading.Thread(target=ctx.copy().run, args=(job._follow, s, sent, None),
                     name=f"rpcnb-bg-{job.id}", daemon=True).start()
    return job


def _failed(exc: BaseException) -> Any:
    import torch

    fut: Any = torch.futures.Future()
    fut.set_exception(exc)
    return fut


def adopted_lines(found: list[BackgroundCell]) -> list[str]:
    """What the attach says of the cells it took over, one line each."""
    lines = []
    for j in found:
        if j.kept_ended:
            lines.append(errors.ADOPTED_ENDED.format(
                id=j.id, worker=j.workers[0], cell=j.line(), origin=j.origin,
                status=j.kept_ended, ago=max(0.0, time.monotonic() - (j.ended or time.monotonic()))))
        else:
            lines.append(errors.ADOPTED_RUNNING.format(
                id=j.id, worker=j.workers[0], cell=j.line(), origin=j.origin,
                seconds=j.elapsed))
    if found:
        lines.append(errors.ADOPTED_HOW)
    return lines


def current_lines(found: list[BackgroundCell],
                  timeout: float = ASK_S) -> dict[int, dict[str, str]]:
    """Where each running cell of ``found`` is now, per worker (``line 4: time.sleep(1)``):
    its workers are asked at once (the ``running`` request); a worker that runs another
    cell (this one waits behind it) or does not answer in ``timeout`` is left out."""
    s = state.active()
    if s is None:
        return {}
    asked = []
    for j in found:
        sent = j._sent
        if sent is None or j.ready():
            continue
        for c in list(sent.calls.values()):
            if not c.done and not s.is_dead(c.worker) and not s.is_unreachable(c.worker):
                try:
                    asked.append((j.id, c, protocol.call_async(s.token, c.worker, "running",
                                                               timeout=timeout)))
                except Exception:
                    pass
    now: dict[int, dict[str, str]] = {}
    for job_id, c, fut in asked:
        try:
            busy = fut.wait()
        except Exception:
            continue
        if busy and busy.get("call_id") == c.call_id:
            now.setdefault(job_id, {})[c.worker] = members.where(busy) or "-"
    return now


def jobs(include_ended: bool = True) -> list[BackgroundCell]:
    """This process's background cells of the current group, oldest first.

    ``%rpc_jobs`` shows them as a table.

    Args:
        include_ended: also the cells that have ended (``%rpc_jobs --all``); False: only
            those still running or queued.

    Returns:
        A list of ``BackgroundCell`` handles, oldest first.

    Raises:
        rpcnb.RpcnbError: this process is in no group.
    """
    s = state.current()
    found = sorted(s.jobs().values(), key=lambda j: j.id)
    # a cell that ended while no kernel was attached is news to this one: listed as well
    return [j for j in found if include_ended or not j.ready() or j.kept_ended]


def show(job_id: int) -> None:
    """``%rpc_jobs ID``: the cell's row, what an adopted cell printed while no kernel was
    attached, and how it ended (its value, or its error and remote traceback)."""
    s = state.current()
    known = s.jobs()
    job = known.get(job_id)
    if job is None:
        raise RpcnbError(errors.NO_SUCH_JOB.format(
            id=job_id, known=", ".join(f"[{i}]" for i in sorted(known)) or "none"))
    print(JobTable([job]))
    if job.origin:
        print(errors.BG_KEPT_HEADER.format(workers=", ".join(job.workers), origin=job.origin))
        job.output()
    if not job.ready():
        return
    err = job.error()
    if err is None:
        print(errors.BG_RESULT.format(id=job.id, value=repr(job.result(0))))
    else:
        print(errors.BG_FAILED.format(id=job.id, error=f"{type(err).__name__}: {err}"))
        tb = getattr(err, "traceback", "")
        if tb:
            print(tb.rstrip())


class JobTable:
    """What ``%rpc_jobs`` shows: a plain-text table of background cells, with the line
    each running one is at now on each of its workers (asked when the table is made)."""

    def __init__(self, found: list[BackgroundCell], ask: bool = True) -> None:
        self.jobs = found
        self.now = current_lines(found) if ask else {}

    def __str__(self) -> str:
        if not self.jobs:
            return "No background cells: %%remote WORKER --bg starts one."
        rows = [("id", "workers", "status", "seconds", "cell", "now")]
        for j in self.jobs:
            now = self.now.get(j.id, {})
            rows.append((f"[{j.id}]", ",".join(j.workers), j.status, f"{j.elapsed:.1f}",
                         j.line(), "; ".join(where if len(now) == 1 else f"{w}: {where}"
                                             for w, where in now.items())))
        adopted = [j for j in self.jobs if j.origin]
        note = "\n" + errors.ADOPTED_NOTE.format(
            ids=", ".join(f"[{j.id}]" for j in adopted),
            origins=", ".join(sorted({j.origin for j in adopted}))) if adopted else ""
        return text.table(rows) + note

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


class _Progress:
    """wait_interactive's bar (tqdm.auto): workers done, seconds so far, the cell's status."""

    def __init__(self, job: BackgroundCell) -> None:
        self.job = job
        self.bar = progress.tqdm(total=len(job.workers), desc=f"[{job.id}] workers done",
                                 unit="worker", leave=True)

    def update(self, final: bool = False) -> None:
        j = self.job
        self.bar.n = len(j.workers) - len(j.pending_workers())
        self.bar.set_postfix_str(j.status, refresh=False)
        self.bar.refresh()
        if final:
            self.bar.close()
