"""Where a remote cell runs: every member has one ``CellRunner``. Cells sent to it queue
and run one at a time in the member's namespace, like cells in a kernel, and each ends
with a ``CellResult`` (an RRef, a value, or an error, never raised).

In a worker process the runner owns the main thread, so an interrupt is a plain SIGINT;
in a kernel it runs on a thread of its own and an interrupt is an asynchronous exception.
"""

from __future__ import annotations

import ast
import bdb
import collections
import contextlib
import ctypes
import linecache
import operator
import os
import queue
import re
import signal
import sys
import threading
import time
import traceback
import types
from dataclasses import dataclass, field, fields
from typing import Any

from rpcnb import errors, progress
from rpcnb.cells import comms, console, profiles
from rpcnb.cells.orphans import Orphans
from rpcnb.cells.output import router
from rpcnb.paths import shm, ucx, zerocopy
from rpcnb.session import protocol, state

NOT_STARTED = "interrupted before it started"  # a queued cell's error: it never ran


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
    copy_tensors: bool = False  # the call said zero_copy=False: pickled under copying()
    profile: dict[str, Any] | None = None  # with --profile: {"table": str, "trace": bytes}

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # its fields in order, not a dict of them: half the bytes, and loaded by one call.
        # Members of a group share rendezvous.PROTOCOL: a change of the fields' number or
        # order changes what travels, and needs it raised (tests/unit/test_cell_runner.py)
        return CellResult, _cell_result_fields(self)

    def wire(self) -> Any:
        """What the cell's future is completed with. Most cells ran, and had no value or had
        one fetched, with no profile and no copy asked: they travel as the plain tuple
        ``(duration, outputs)`` or ``(duration, outputs, value)``, whose pickling and
        loading cost a fraction of this class's on both sides (docs/benchmarks.md: about a
        twentieth of a no-op cell's round trip on two cores). Any other result travels as
        itself. The caller reads either (``rpcnb.cells.call``)."""
        if self.ok and self.rref is None and self.profile is None and not self.copy_tensors:
            if self.has_value:
                return (self.duration, self.outputs, self.value)
            return (self.duration, self.outputs)
        return self


_cell_result_fields = operator.attrgetter(*(f.name for f in fields(CellResult)))


@dataclass
class Job:
    """One remote cell, as sent by ``caller``."""

    token: str
    call_id: str
    caller: str
    source: str
    fetch: bool
    push: dict[str, Any]
    future: Any  # a torch Future the result is set on
    zero_copy: bool = True  # False: a fetched tensor in shared memory is copied
    profile: bool = False  # run under torch.profiler (%%remote --profile)
    filename: str = ""


# the name of a remote cell's code, on any member: "<worker1 cell 3>"
CELL_FILE = re.compile(r"<\S+ cell \d+>\Z")


@dataclass
class Running:
    """The cell a runner runs now (``CellRunner.running``), as %rpc_workers, %rpc_jobs,
    %rpc_stacks and the panel show a busy member: which cell, since when, and where it
    is now (the innermost frame of a cell's code: a function defined in an earlier cell
    is named by its own cell)."""

    cell: str  # "<worker1 cell 3>"
    first: str  # the cell's first line
    call_id: str
    caller: str
    since: float  # time.time() when it started
    seconds: float  # how long it had run when asked
    thread: int  # the ident of the thread that runs it
    thread_name: str
    file: str = ""  # where it is now ("": in no cell's code, e.g. rpcnb's before or after it)
    line: int = 0
    text: str = ""
    # with stack=True: (file, line, function, text) from the cell's own frame in, outermost
    # first (rpcnb's frames around it left out)
    stack: list[tuple[str, int, str, str]] = field(default_factory=list)


class CellRunner:
    """Runs remote cells one at a time in ``namespace``."""

    def __init__(self, name: str, namespace: dict[str, Any], shell: Any = None) -> None:
        self.name = name
        self.namespace = namespace
        self.shell = shell
        self.cells_run = 0
        self.on_main = False  # a worker process's runner owns the main thread
        self.kind_name: str | None = None  # what %rpc_workers calls it, when not the default
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._current: Job | None = None
        self._since = 0.0  # when the current cell began (time.monotonic)
        self._thread_id: int | None = None
        self._stopped = threading.Event()
        self._cancelled: set[str] = set()
        self._queued: dict[str, Job] = {}  # call id -> a cell sent here that has not begun
        self._spare: collections.deque[Any] = collections.deque()  # a Future made while idle
        self.orphans = Orphans(name)  # cells whose caller went away (a kept group's kernel)

    @property
    def kind(self) -> str:
        """"process" for a worker process rpcnb started, "kernel" for a kernel, or what
        ``kind_name`` says ("engine", "headless")."""
        if self.kind_name:
            return self.kind_name
        return "process" if self.on_main else "kernel"

    @property
    def thread(self) -> int | None:
        """The ident of the thread that runs the cells (None before it has started)."""
        return self._thread_id

    # -- called from RPC threads
    def future(self) -> Any:
        """The torch Future a new cell's result will be set on: one this runner made while
        it was idle, if there is one (making it took 8-9 us of a request's path on two
        cores, a tenth of what a no-op cell costs beyond a plain call), else a new one."""
        try:
            return self._spare.pop()
        except IndexError:
            return _new_future()

    def submit(self, job: Job) -> None:
        with self._lock:
            self._queued[job.call_id] = job
        self._queue.put(job)

    def position(self, call_id: str) -> str | None:
        """What runs here while the cell ``call_id`` waits in the queue (its name, who sent
        it, for how long), or None when that cell runs, has ended or is unknown."""
        with self._lock:
            if call_id not in self._queued:
                return None
            job = self._current
            since = self._since
        if job is None:
            return None  # about to begin
        return errors.BUSY_WITH.format(cell=job.filename.strip("<>"), caller=job.caller,
                                       seconds=time.monotonic() - since)

    def interrupt(self, call_id: str) -> bool:
        with self._lock:
            job = self._current
            if job is None or job.call_id != call_id or self._thread_id is None:
                # Not running yet: drop it from the queue, and say so at once (the caller
                # need not wait for the cell before it to end)
                self._cancelled.add(call_id)
                queued = self._queued.pop(call_id, None)
                if queued is not None:
                    queued.future.set_result(CellResult(
                        self.name, False, ename="KeyboardInterrupt", evalue=NOT_STARTED))
                return False
            if self.on_main:
                signal.pthread_kill(self._thread_id, signal.SIGINT)
            else:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._thread_id), ctypes.py_object(KeyboardInterrupt)
                )
            return True

    def running(self, stack: bool = False) -> Running | None:
        """The cell running now and where it is, or None when idle; ``stack``: with its
        frames. Read from another thread (an RPC thread: also while the cell's thread is
        in a C call, which holds no GIL)."""
        with self._lock:
            job, since, tid = self._current, self._since, self._thread_id
        if job is None or tid is None:
            return None
        frame = sys._current_frames().get(tid)
        frames = list(traceback.walk_stack(frame))[::-1] if frame is not None else []
        first = next((ln.strip() for ln in job.source.splitlines() if ln.strip()), "")
        took = time.monotonic() - since
        found = Running(job.filename, first, job.call_id, job.caller, time.time() - took,
                        took, tid, _thread_name(tid))
        cell = [i for i, (f, _) in enumerate(frames) if CELL_FILE.match(f.f_code.co_filename)]
        if stack:  # from the cell's own frame in; all of them where it is in none
            found.stack = [_frame_line(f, lineno, job.filename)
                           for f, lineno in (frames[cell[0]:] if cell else frames)]
        if cell:
            found.file, found.line, _, found.text = _frame_line(*frames[cell[-1]], job.filename)
        return found

    def caller_gone(self, name: str) -> None:
        """The member ``name`` died or left: its cell running here runs on as an orphan,
        its output and result kept for a kernel that attaches (``rpcnb.cells.orphans``)."""
        with self._lock:
            job, since = self._current, self._since
        self.orphans.caller_gone(name, job, time.time() - (time.monotonic() - since))

    def stop(self) -> None:
        self._stopped.set()
        self._queue.put(None)

    # -- the loop
    def run_forever(self) -> None:
        self._thread_id = threading.get_ident()
        while not self._stopped.is_set():
            try:
                if not self._spare:  # after a cell has answered: the next one's Future
                    self._spare.append(_new_future())
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

    def _run(self, job: Job) -> None:
        with self._lock:
            self._queued.pop(job.call_id, None)
            cancelled = job.call_id in self._cancelled
            self._cancelled.discard(job.call_id)
        if cancelled:
            if not job.future.done():
                job.future.set_result(CellResult(self.name, False, ename="KeyboardInterrupt",
                                                 evalue=NOT_STARTED))
            return
        self.cells_run += 1
        job.filename = f"<{self.name} cell {self.cells_run}>"
        t0 = time.perf_counter()
        try:
            # its output's Capture is made at its first write (most cells write nothing);
            # entered inside the try, so that an interrupt cannot skip the leave
            router.enter((job.call_id, job.caller, self.name, job.token), self.on_main)
            if job.push and progress.payload_bytes(list(job.push.values()),
                                                   free=_by_handle(job)) \
                    >= progress.large_transfer(state.current().one_host):
                router.opened().mark({"stage": "received", "worker": self.name})
            with self._lock:
                self._current, self._since = job, time.monotonic()
            if self.orphans.gone:  # a caller went away (a kept group's kernel): its cell's?
                self.orphans.starting(job)
            try:
                if job.profile:
                    result, found = profiles.profiled(lambda: self._execute(job))
                else:
                    result, found = self._execute(job), None
            finally:
                with self._lock:
                    self._current = None
            result.profile = found
        except BaseException as exc:  # KeyboardInterrupt included: the worker lives on
            console.kept.keep("cell", exc, job.filename.strip("<>"))  # for %debug
            missing = comms.hint(exc, self.name)  # a widget library not installed here
            more = f"\n{missing}" if missing else ""
            evalue = safe_str(exc) or (errors.PDB_QUIT.format(worker=self.name)
                                       if isinstance(exc, bdb.BdbQuit) else "")
            quit_pdb = isinstance(exc, bdb.BdbQuit)  # its frames are pdb's: none shown
            result = CellResult(self.name, False, ename=type(exc).__name__,
                                evalue=evalue + more,
                                traceback="" if quit_pdb else
                                format_exception(exc, job.filename) + more)
        finally:
            console.untrace()
            cap = router.leave(process_wide=self.on_main)
        result.duration = time.perf_counter() - t0
        if cap is not None:
            try:
                result.outputs = cap.close()
            except KeyboardInterrupt:
                result.outputs = cap.close()
        # the reply is pickled on whichever thread completes or awaits the future: the
        # result itself says to copy (rpcnb.paths.serialize reads it)
        result.copy_tensors = not job.zero_copy
        wire = result.wire()
        if self.orphans.cells:  # its caller went away: kept for the kernel that adopts it
            self.orphans.ended(job.call_id, result.ok, result.ename, wire)
        job.future.set_result(wire)

    def _execute(self, job: Job) -> CellResult:
        ns = self.namespace
        if job.push:
            ns.update(job.push)
        value, has_value = run_source(job.source, job.filename, ns, self.shell)
        if not has_value or value is None:
            return CellResult(self.name, True)
        if job.fetch:
            from rpcnb.wire import _torch

            try:
                with shm.suppressed():  # a dry run: no buffer taken
                    _torch.rpc_pickler().serialize(value)
            except Exception as exc:
                return CellResult(
                    self.name, False, ename=type(exc).__name__,
                    evalue=errors.NOT_PICKLABLE.format(
                        name=self.name, type=type(value).__name__, reason=exc),
                )
            # a tensor sent back by handle takes no time: no bar, and no message to start
            # one (it cost about 0.8 ms of a 100 MB --fetch on one host)
            nbytes = progress.payload_bytes(value, free=_by_handle(job))
            if nbytes >= progress.large_transfer(state.current().one_host):
                router.opened().out_of_band("progress", {"stage": "sending",
                                                         "worker": self.name, "bytes": nbytes})
            return CellResult(self.name, True, value=value, has_value=True)
        return CellResult(self.name, True, rref=make_rref(self.name, value), has_value=True)


def _new_future() -> Any:
    import torch  # loaded by then: the member's RPC runs on it

    return torch.futures.Future()


def _frame_line(frame: Any, lineno: int, cell: str) -> tuple[str, int, str, str]:
    """(file, line, function, text) of a frame; a cell's own code is named ``cell``, also
    when it runs the code kept from the cell's first run (``run_source``)."""
    code = frame.f_code
    name = code.co_filename
    shown = cell if code.co_name == "<module>" and CELL_FILE.match(name) else name
    return shown, lineno or 0, code.co_name, linecache.getline(name, lineno or 0).strip()


def _thread_name(ident: int) -> str:
    return next((t.name for t in threading.enumerate() if t.ident == ident), f"thread {ident}")


def _by_handle(job: Job) -> Any:
    """What tells, for this cell, a tensor that travels by handle (None: none does)."""
    return zerocopy.by_handle if job.zero_copy else None


def make_rref(me: str, value: Any) -> Any:
    """An RRef owned here. A tensor RRef made by rpc.RRef() is fetched by TorchScript's
    pickler, which rpcnb cannot route; a large CPU tensor is wrapped in a Python-object
    RRef instead (made by a remote call to ourselves) so that ``to_here()`` takes the
    shared-memory path."""
    import torch
    import torch.distributed.rpc as rpc

    if isinstance(value, torch.Tensor) and (shm.wants(value) or ucx.wants(value)):
        s = state.current()
        key = os.urandom(8).hex()
        s.park(key, value)
        return protocol.remote(s.token, me, "unpark", key)
    return rpc.RRef(value)


# What IPython's input transformers act on (magics %, shell !, help ?, the escapes , ; /
# at a line's start, pasted prompts, an indented first line): a cell with none of them is
# plain Python, and tokenizing it through IPython (a tenth of a small cell's time) is skipped.
_IPYTHON_CHARS = re.compile(r"[%!?]")
_IPYTHON_LINE = re.compile(r"^[ \t]*([,;/]|>>>|\.\.\.|In \[)", re.M)


def plain_python(source: str) -> bool:
    """Whether IPython's transform_cell would leave ``source`` as it is."""
    if _IPYTHON_CHARS.search(source) or _IPYTHON_LINE.search(source):
        return False
    first = next((line for line in source.splitlines() if line.strip()), "")
    return not first[:1].isspace()


def run_source(source: str, filename: str, ns: dict[str, Any], shell: Any = None) -> tuple[Any, bool]:
    """Execute a cell; return (value of the last expression, whether there was one)."""
    # a cell found plain before (a loop of ``rpcnb.run(w, "step()")``) is not tested again
    plain = shell is None or source in COMPILED.plain
    if plain:
        kept = COMPILED.code.get(source)
        if kept is not None and kept[3] is not None:
            # run before, and with no code of its own: its code runs as compiled for the
            # first run (a code object made for each run cost about a tenth of a no-op
            # cell's round trip: making it, and the interpreter warming it up each time).
            # Its frames carry the first run's name (so do a traceback or a warning the
            # cell prints itself); format_exception shows this run's
            body, last, _, lines = kept
            if linecache.cache.get(lines[3]) is not lines:
                linecache.cache[lines[3]] = lines  # a traceback printed by the cell needs it
            try:
                exec(body, ns)
                return (None, False) if last is None else (eval(last, ns), True)
            except BaseException as exc:
                # what format_exception needs, even once this code is no longer kept
                with contextlib.suppress(Exception):
                    exc._rpcnb_ran_as = lines  # type: ignore[attr-defined]
                raise
    elif not plain_python(source):
        source = shell.transform_cell(source)
    else:
        plain = True
        if len(source) < 4096:
            COMPILED.keep_plain(source)
    lines = linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    body, last, leaf = _compiled(source, filename, lines if plain else None)
    exec(body, ns)
    value, has_value = (None, False) if last is None else (eval(last, ns), True)
    kept = COMPILED.code.get(source)
    if leaf and linecache.cache.get(filename) is lines and (kept is None or kept[3] is not lines):
        # it ran, and made no code object (function, class, lambda, generator expression;
        # a comprehension before Python 3.12, which inlines them) that would keep its name:
        # nothing asks for its lines again (a failed cell's stay, for its traceback). A
        # plain one's stay as long as its code is kept: one entry however often it runs. A
        # loop of ``rpcnb.run(w, "step()")`` leaves no entry per cell. The cell may have
        # cleared linecache itself (torch.compile's workers do): then there is none to drop
        linecache.cache.pop(filename, None)
    return value, has_value


_CODE_KEPT = 256


class CompiledCells:
    """The cells this process has compiled, by source, so that one run again is not parsed
    and compiled again (``_CODE_KEPT`` of each, then all are dropped at once; kept for the
    process, whatever group it is in)."""

    def __init__(self) -> None:
        # source -> its compiled body, its last expression, whether neither holds code of
        # its own, and, for a plain cell with none, its lines as linecache holds them (its
        # first run's name)
        self.code: dict[str, tuple[Any, Any, bool, Any]] = {}
        self.plain: set[str] = set()  # cells found plain Python (``plain_python``)

    def keep_plain(self, source: str) -> None:
        if len(self.plain) >= _CODE_KEPT:
            self.plain.clear()
        self.plain.add(source)

    def keep(self, source: str, entry: tuple[Any, Any, bool, Any]) -> None:
        if len(self.code) >= _CODE_KEPT:
            for *_, lines in list(self.code.values()):  # a kept cell's lines go with it
                name = None if lines is None else lines[3]
                if name is not None and linecache.cache.get(name) is lines:
                    linecache.cache.pop(name, None)
            self.code.clear()
        self.code[source] = entry


COMPILED = CompiledCells()


def _compiled(source: str, filename: str, lines: Any) -> tuple[Any, Any, bool]:
    """The cell's code: its body, its last expression (None when it has none), and whether
    neither holds code objects of its own (functions, classes, lambdas, generators). A
    cell run again is parsed and compiled once; one with code of its own has it renamed
    after the new cell (a function keeps the name of the run that made it). ``lines``:
    the linecache entry of a plain cell, kept with a code that needs no renaming."""
    kept = COMPILED.code.get(source)
    if kept is not None:
        body, last, leaf, _ = kept
        return (_renamed(body, filename), None if last is None else _renamed(last, filename),
                leaf)
    tree = ast.parse(source, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
        expr = tree.body.pop()
        assert isinstance(expr, ast.Expr)
        last = compile(ast.Expression(expr.value), filename, "eval")
    body = compile(tree, filename, "exec")
    leaf = not any(type(c) is types.CodeType
                   for code in (body, last) if code is not None for c in code.co_consts)
    if len(source) < 4096:
        COMPILED.keep(source, (body, last, leaf, lines if leaf else None))
    return body, last, leaf


def _renamed(code: Any, filename: str) -> Any:
    if code.co_filename == filename:
        return code
    consts = code.co_consts
    if any(type(c) is types.CodeType for c in consts):  # functions, classes, comprehensions
        return code.replace(co_filename=filename, co_consts=tuple(
            _renamed(c, filename) if type(c) is types.CodeType else c for c in consts))
    return code.replace(co_filename=filename)


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, or what can be said of it when its ``__str__`` raises."""
    try:
        return str(exc)
    except Exception as err:
        return f"<its message cannot be shown: {type(err).__name__} in {type(exc).__name__}.__str__>"


def format_exception(exc: BaseException, filename: str) -> str:
    """The traceback from the cell's own frames on (rpcnb's frames dropped). A cell that ran
    the kept code of its first run (``run_source``) has its frames, and those of the
    exceptions chained to its error, shown under ``filename``, the run's own name."""
    ran_as: Any = getattr(exc, "_rpcnb_ran_as", None)
    first = filename if ran_as is None else ran_as[3]
    added = ran_as is not None and linecache.cache.get(first) is not ran_as
    if added:  # the cell cleared linecache, or its code was dropped from COMPILED meanwhile
        linecache.cache[first] = ran_as
    try:
        te = traceback.TracebackException.from_exception(exc)
    finally:
        if added:
            linecache.cache.pop(first, None)
    if first != filename:
        _rename(te, first, filename, set())
    frames = list(te.stack)
    for i, fr in enumerate(frames):
        if fr.filename == filename:
            te.stack = traceback.StackSummary.from_list(frames[i:])
            break
    else:
        te.stack = traceback.StackSummary.from_list([])
    return "".join(te.format())


def _rename(te: Any, first: str, filename: str, seen: set[int]) -> None:
    """Show ``te``'s frames named ``first`` under ``filename``, through its chain (cause,
    context, an exception group's members); their lines were read under their own name."""
    if id(te) in seen:
        return
    seen.add(id(te))
    for fr in te.stack:
        if fr.filename == first:
            fr.filename = filename
    for more in (te.__cause__, te.__context__, *(getattr(te, "exceptions", None) or ())):
        if more is not None:
            _rename(more, first, filename, seen)
