"""The notebook as the workers' console: ``input()``, ``getpass``, ``sys.stdin``, ``pdb``
and post-mortem debugging of remote code, answered in the notebook cell that waits.

Where the code runs (a worker process), ``install_worker`` replaces ``input``,
``getpass.getpass``, ``sys.stdin`` and ``sys.breakpointhook``: a read becomes an ``ask``
request to the member the running cell or call came from (its ``Capture``'s caller),
answered there, and a breakpoint opens a ``RemotePdb`` that reads its commands the same
way. The worker keeps the last failure of a cell and of a call (``Kept``), so that
``%debug`` in the notebook opens pdb on its frames (``post_mortem``, run there as a cell).

Where the cell waits (the kernel), ``Question`` is what arrives: the waiting cell's thread
asks the user (``answer``) with the worker's name before the prompt; a question nobody
can answer (a background cell, a run without stdin, code another member started) is
answered at once with the reason, which the worker raises as ``NoInput`` (an EOFError).
"""

from __future__ import annotations

import bdb
import builtins
import functools
import getpass
import io
import pdb
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from rpcnb import errors, settings
from rpcnb.cells.frames import hidden, user_frames
from rpcnb.cells.output import router
from rpcnb.session import protocol

POLL = 0.02  # seconds between looks at an answer's future (an interrupt gets in between)
ANSWER = "answer"
EOF = "eof"
NONE = "none"  # nobody can answer: the reply's text says why


class NoInput(EOFError):
    """Remote code asked for input that nobody can give (the message says why and what
    to do). An ``EOFError``, so code that handles end of input handles it too."""


# -- where the code runs ---------------------------------------------------------------


def ask(prompt: str = "", password: bool = False) -> str:
    """A line typed in the notebook cell that waits for the running cell or call (without
    its newline). Raises NoInput where no cell waits, EOFError on end of input."""
    where = router.where()
    if where is None:
        raise NoInput(errors.INPUT_NOBODY.format(worker=_me(), why=errors.INPUT_NO_CELL))
    call_id, caller, worker, token = where
    cap = router.current()
    if cap is not None and cap is not router.background:
        cap.settle()  # what it printed before reaches the cell before the prompt does
    try:
        fut = protocol.call_async(token, caller, "ask", call_id, worker, str(prompt),
                                  bool(password), timeout=0)
    except Exception as exc:  # the caller is gone
        raise NoInput(errors.INPUT_NOBODY.format(worker=worker, why=exc)) from None
    while not fut.done():  # a poll, not a wait in C++: an interrupt of the cell gets in
        time.sleep(POLL)
    try:
        kind, text = fut.wait()
    except Exception as exc:
        raise NoInput(errors.INPUT_NOBODY.format(worker=worker, why=exc)) from None
    if kind == ANSWER:
        return str(text)
    if kind == EOF:
        raise EOFError
    raise NoInput(errors.INPUT_NOBODY.format(worker=worker, why=text))


def _me() -> str:
    from rpcnb.session import state

    s = state.active()
    return s.name if s is not None else "this process"


def remote_input(prompt: Any = "") -> str:
    """``input()`` in remote code."""
    return ask(str(prompt))


def remote_getpass(prompt: str = "Password: ", stream: Any = None) -> str:
    """``getpass.getpass()`` in remote code: asked in the notebook without echo."""
    return ask(prompt, password=True)


class RemoteStdin(io.TextIOBase):
    """``sys.stdin`` in remote code: each line read is asked for in the notebook (an
    empty prompt); end of input (Ctrl-D, or an answer of ``\\x04``) reads as ``""``."""

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        try:
            return ask("") + "\n"
        except NoInput:
            raise
        except EOFError:
            return ""

    def read(self, size: int | None = -1) -> str:
        if size is not None and size >= 0:
            return self.readline()[:size]
        lines = []
        while line := self.readline():
            lines.append(line)
        return "".join(lines)

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a worker's stdin is the notebook: it has no file descriptor")

    def isatty(self) -> bool:
        return False


# modules whose frames are rpcnb's or torch's RPC machinery: never shown, never stopped in
HIDDEN = ("rpcnb", "rpcnb.*", "torch.distributed.*", "torch.futures", "threading",
          "concurrent.*")


class RemotePdb(pdb.Pdb):
    """pdb on a worker, its commands read in the notebook (``input``, replaced by ``ask``),
    its output the cell's. rpcnb's and torch RPC's frames are hidden: ``w`` shows the
    cell's frames and those it called, ``up`` stops at the cell, ``n`` past the cell's
    end lets it finish. It leaves SIGINT alone: an interrupt of the notebook ends the
    session and the cell."""

    def __init__(self) -> None:
        super().__init__(skip=list(HIDDEN), nosigint=True, readrc=False)
        self.prompt = "(Pdb) "
        self.whole = False  # show every frame given (post-mortem)

    def get_stack(self, f: Any, t: Any) -> tuple[list[Any], int]:
        stack, i = super().get_stack(f, t)
        if self.whole:  # a post-mortem: the kept traceback, trimmed when it was kept
            return stack, i
        # the frames from the cell's (or the called function's) on: outward from the
        # current frame up to the first of rpcnb's or torch RPC's (the runner, the RPC
        # agent, the worker's main above them); a post-mortem's traceback starts there
        cut = 0
        for k in range(min(i, len(stack) - 1), -1, -1):
            if hidden(stack[k][0]):
                cut = k + 1
                break
        if cut > i:  # stopped in a hidden frame (should not be): show it all
            return stack, i
        return stack[cut:], i - cut


def breakpoint_hook(*args: Any, **kwargs: Any) -> None:
    """``sys.breakpointhook`` in a worker: ``PYTHONBREAKPOINT`` as Python reads it (``0``:
    nothing; another hook: that one), else a ``RemotePdb`` in the waiting cell."""
    hook = settings.other("PYTHONBREAKPOINT")
    if hook == "0":
        return None
    if hook and hook not in ("pdb.set_trace", "rpcnb.cells.console.set_trace"):
        return sys.__breakpointhook__(*args, **kwargs)
    return _stop_in(sys._getframe(1))


def set_trace(*, header: str | None = None) -> None:
    """``pdb.set_trace()`` in a worker: a ``RemotePdb`` in the waiting cell."""
    if header is not None:
        print(header)
    _stop_in(sys._getframe(1))


def _stop_in(frame: Any) -> None:
    if router.where() is None:
        raise NoInput(errors.INPUT_NOBODY.format(worker=_me(), why=errors.INPUT_NO_CELL))
    RemotePdb().set_trace(frame)


def untrace() -> None:
    """At a cell's end: a ``RemotePdb`` still tracing this thread (``n`` past the cell's
    last line) stops, so it does not stop in the next cell."""
    tracer = sys.gettrace()
    if tracer is not None and isinstance(getattr(tracer, "__self__", None), RemotePdb):
        sys.settrace(None)


@dataclass
class Failure:
    """A failure kept for post-mortem: the exception, its traceback from the first frame
    that is not rpcnb's, and where it happened (a cell's name, or a call's function)."""

    exc: BaseException
    tb: Any
    where: str
    at: float


class NothingToDebug(RuntimeError):
    """``%debug`` found no kept failure on the worker (not itself kept as one)."""


class Kept:
    """The last failure of a remote cell and of a call another member made, in this process
    (what ``%debug`` in the notebook debugs); their frames stay alive, as IPython's
    ``sys.last_traceback`` keeps a local cell's."""

    def __init__(self) -> None:
        self.cell: Failure | None = None
        self.call: Failure | None = None

    def keep(self, kind: str, exc: BaseException, where: str) -> None:
        if isinstance(exc, (KeyboardInterrupt, bdb.BdbQuit, SystemExit, NothingToDebug)):
            return
        tb = user_frames(exc.__traceback__)
        if tb is None:
            return
        setattr(self, kind, Failure(exc, tb, where, time.time()))


kept = Kept()


def post_mortem(kind: str = "cell") -> None:
    """pdb on the frames of this process's last failed cell (``kind="call"``: of the last
    failed call another member made), in the cell that runs this (``%debug``)."""
    failure: Failure | None = getattr(kept, kind, None)
    if failure is None:
        raise NothingToDebug(errors.NOTHING_TO_DEBUG.format(
            worker=_me(), what="cell" if kind == "cell" else "call from another member"))
    print(f"{type(failure.exc).__name__}: {failure.exc}  ({failure.where})")
    p = RemotePdb()
    p.whole = True
    p.reset()
    p.interaction(None, failure.tb)


@functools.cache  # once per process, from its main thread as it starts
def install_worker() -> None:
    """In a worker process: ``input``, ``getpass``, ``sys.stdin``, ``breakpoint()`` and
    ``pdb.set_trace`` go to the notebook (once; after the worker read its secret)."""
    router.on_call_failure = lambda exc, func: kept.keep("call", exc, f"call of {func}")
    builtins.input = remote_input
    getpass.getpass = remote_getpass
    pdb.set_trace = set_trace
    sys.stdin = RemoteStdin()
    sys.breakpointhook = breakpoint_hook


# -- where the cell waits ----------------------------------------------------------------


@dataclass
class Question:
    """A worker's request for a line of input, waiting for its answer (``future``)."""

    worker: str
    prompt: str
    password: bool
    future: Any  # a torch Future, completed with (kind, text)

    def reply(self, kind: str, text: str = "") -> None:
        if not self.future.done():
            self.future.set_result((kind, text))


def answer(q: Question) -> None:
    """Ask the user here (the thread of the cell that waits) and reply. An interrupt
    replies that nobody answered, and goes on up (the cell is interrupted)."""
    from rpcnb.cells.output import shell

    prompt = f"[{q.worker}] {q.prompt}"
    sh = shell()
    kernel = getattr(sh, "kernel", None)
    try:
        if kernel is not None:
            if not getattr(kernel, "_allow_stdin", True):
                q.reply(NONE, errors.INPUT_NO_STDIN)
                return
            text = kernel.getpass(prompt) if q.password else kernel.raw_input(prompt)
        elif sys.stdin is not None and sys.stdin.isatty():
            text = getpass.getpass(prompt) if q.password else input(prompt)
        else:
            q.reply(NONE, errors.INPUT_NO_STDIN)
            return
    except EOFError:
        q.reply(EOF)
        return
    except KeyboardInterrupt:
        q.reply(NONE, errors.INPUT_INTERRUPTED)
        raise
    except Exception as exc:  # StdinNotImplementedError: a front end without stdin
        q.reply(NONE, f"{errors.INPUT_NO_STDIN} ({exc})")
        return
    q.reply(ANSWER, text)


_asking = threading.Lock()  # one prompt at a time for questions from calls


def can_ask_here() -> bool:
    """Whether a user can answer here: a kernel whose front end takes input, or a terminal."""
    from rpcnb.cells.output import shell

    kernel = getattr(shell(), "kernel", None)
    if kernel is not None:
        return bool(getattr(kernel, "_allow_stdin", True))
    return sys.stdin is not None and not isinstance(sys.stdin, RemoteStdin) and sys.stdin.isatty()


def answer_call(q: Question, can_ask: bool) -> None:
    """A question from a call this process made (``rpc_sync`` in a cell): asked on a
    thread of its own, one at a time, where a user can answer; else answered with why not."""
    if not can_ask:
        q.reply(NONE, errors.INPUT_NOT_HERE.format(caller=_me()))
        return

    def go() -> None:
        with _asking:
            try:
                answer(q)
            except BaseException as exc:  # never leave the worker waiting
                q.reply(NONE, f"{type(exc).__name__}: {exc}")

    threading.Thread(target=go, name="rpcnb-input", daemon=True).start()


def route(s: Any, call_id: str | None, q: Question) -> None:
    """A worker running a cell (``call_id``) or a call (None) of this process asks for a
    line of input: the thread that waits for the cell asks the user (``rpcnb.cells.call``
    reads its inbox); a call's question is asked on a thread of its own where a user can
    answer; anything else is answered with why not."""
    if call_id is None:
        answer_call(q, can_ask_here())
        return
    call = s.call(call_id)
    if call is None:  # the cell was given up on meanwhile
        q.reply(NONE, errors.INPUT_GIVEN_UP)
        return
    call.ask(q)


def take(q: Question, here: bool, interrupted: bool, finish_output: Any) -> None:
    """A question that arrived in a waiting cell's inbox: asked, by the notebook's own cell
    (``here``) while it is not being interrupted, below all the output before it."""
    if not here:
        q.reply(NONE, errors.INPUT_BACKGROUND.format(worker=q.worker))
    elif interrupted:
        q.reply(NONE, errors.INPUT_INTERRUPTED)
    else:
        finish_output()
        answer(q)


# -- interrupts and queues, as the waiting cell tells them ---------------------------------

QUEUE_CHECK = 0.5  # seconds after which a cell that printed nothing asks if it still waits


def look_at_queues(s: Any, calls: dict[str, Any], told: set[str], waited: float) -> bool:
    """Once a cell has waited ``QUEUE_CHECK`` without a word from a worker, ask that worker
    (``cell_position``) whether the cell still waits in its queue behind another (one that
    went on after an interrupt, another kernel's), and say so at once, with what to do.
    True once every worker has answered (or the cell ended there)."""
    if waited < QUEUE_CHECK:
        return False
    for c in calls.values():
        if c.position is None and not c.done and c.next_seq == 0 and not c.held \
                and c.worker not in told and not s.is_dead(c.worker):
            try:
                c.position = protocol.call_async(s.token, c.worker, "cell_position",
                                                 c.call_id, timeout=5)
            except Exception:
                told.add(c.worker)  # it cannot be asked: not again
    for c in calls.values():
        if c.position is None or not c.position.done():
            continue
        try:
            what = c.position.wait()
        except Exception:
            what = None
        c.position = None
        told.add(c.worker)
        if what:
            print(errors.WAITS_BEHIND.format(worker=c.worker, what=what), file=sys.stderr)
    return all(c.worker in told or c.done for c in calls.values())


def interrupted(late: list[str], never: list[str]) -> None:
    """Raise the KeyboardInterrupt of an interrupted cell: one that says the code went on
    on ``late`` (and what ends it); before it, that it never ran on ``never``."""
    if late:
        raise KeyboardInterrupt(errors.STILL_RUNS.format(
            workers=", ".join(late), them="it" if len(late) == 1 else "them", first=late[0]))
    if never:
        print(errors.NEVER_RAN.format(workers=", ".join(never)), file=sys.stderr)
    raise KeyboardInterrupt
