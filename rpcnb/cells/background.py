"""Background remote cells (``%%remote WORKER --bg``): sent like any cell, followed by a
thread of their own, so the notebook goes on while they run.

The thread runs in a copy of the starting cell's context: ipykernel keeps the cell a
message belongs to in a context variable, so what the worker prints keeps arriving in the
cell that started it while other cells run. Cells sent later to the same worker queue
behind it there (a worker runs one cell at a time); the handle and the later cell say so.
"""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from rpcnb import errors, progress, text
from rpcnb.cells import call
from rpcnb.session import protocol, state

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
        self._sent: call.Sent | None = None

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
        """'queued behind [1] on worker1', 'running', 'done', 'failed: ...', 'cancelled'."""
        if self._done.is_set():
            if self._error is None:
                return "done"
            if isinstance(self._error, call.Cancelled):
                return "cancelled" + (f" (still running on {', '.join(self._error.late)})"
                                      if self._error.late else "")
            return f"failed: {type(self._error).__name__}"
        waiting = []
        s = state.active()
        jobs = dict(s.background) if s is not None else {}
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
    def _follow(self, s: state.Session, sent: call.Sent, timeout: float | None) -> None:
        try:
            call.wait(s, sent, timeout, prefix=self.many, cancel=self._cancel)
            self._value = sent.outcome(self.many)
        except BaseException as exc:  # noqa: BLE001 - kept for result(); shown below
            self._error = exc
        finally:
            sent.forget(s)
            self.ended = time.monotonic()
            self._done.set()
        if self._error is not None:
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
    with s.lock:
        s.jobs_started += 1
        job = BackgroundCell(s.jobs_started, names, source, many, behind)
    sent = call.send(s, names, source, fetch, push, zero_copy)
    job._sent = sent
    with s.lock:
        s.background[job.id] = job
    ctx = contextvars.copy_context()  # the starting cell's: its output goes there
    threading.Thread(target=ctx.run, args=(job._follow, s, sent, timeout),
                     name=f"rpcnb-bg-{job.id}", daemon=True).start()
    return job


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
            if not c.done and c.worker not in s.dead and c.worker not in s.unreachable:
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
            now.setdefault(job_id, {})[c.worker] = state.where(busy) or "-"
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
    with s.lock:
        found = sorted(s.background.values(), key=lambda j: j.id)
    return [j for j in found if include_ended or not j.ready()]


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
        return text.table(rows)

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
