"""Progress the user can watch: one line updated in place (a display in a notebook, a
carriage return in a terminal), a bar for work of known size, a ticker for work of
unknown length (a large transfer, which TensorPipe does in one piece), and a board with
one row per worker for ``%rpc_init``. Nothing here talks to other members.
"""

from __future__ import annotations

import contextvars
import os
import sys
import threading
import time
from typing import Any

from rpcnb import settings, text

LARGE_TRANSFER = 100 << 20  # bytes from which --push/--fetch show progress
# ... to or from a member on another host: 80 ms at 100 MB/s, seconds over a slow link
LARGE_TRANSFER_ACROSS_HOSTS = 8 << 20


def large_transfer(one_host: bool) -> int:
    """Bytes from which a --push or --fetch shows progress, in a group on one host or not
    (a bar shows only once the transfer has taken ``RPCNB_PROGRESS_DELAY`` s anyway)."""
    return LARGE_TRANSFER if one_host else LARGE_TRANSFER_ACROSS_HOSTS


MIN_INTERVAL = 0.1  # seconds between two updates of a display


def shell() -> Any:
    """The IPython shell of this process, or None (a plain script)."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is a dependency
        return None
    return get_ipython()


def _notebook() -> bool:
    sh = shell()
    return sh is not None and getattr(sh, "kernel", None) is not None


def _terminal() -> bool:
    """IPython in a terminal, or a script whose output is a terminal."""
    if shell() is not None:
        return True
    try:
        return sys.stdout.isatty()
    except Exception:
        return False


def tqdm(**kwargs: Any) -> Any:
    """A progress bar from ``tqdm.auto``: a widget in a notebook, text on stderr elsewhere;
    text too in a notebook without ipywidgets (tqdm would refuse there)."""
    from tqdm import std

    cls = std.tqdm
    if _notebook():
        try:
            import ipywidgets  # noqa: F401
            from tqdm.auto import tqdm as cls  # type: ignore[no-redef]
        except ImportError:
            pass
    return cls(**kwargs)


class _Text:
    """A plain-text display object (shown as is in a notebook)."""

    def __init__(self, body: str) -> None:
        self.body = body

    def __repr__(self) -> str:
        return self.body

    def _repr_html_(self) -> str:
        import html

        return (f"<pre class='rpcnb-progress' style='margin:0'>{html.escape(self.body)}"
                "</pre>")


class Line:
    """One line (or block) of text updated in place."""

    def __init__(self, body: str = "", *, terminal_lines: bool = False) -> None:
        self._handle: Any = None
        self._last = 0.0
        self._shown = ""
        self._terminal_lines = terminal_lines  # a terminal gets a line per change
        self.closed = False
        if _notebook():
            from IPython.display import display

            self._handle = display(_Text(body), display_id=True)
            self._shown = body
        elif body:
            self._write(body)

    def update(self, body: str, force: bool = False) -> None:
        if self.closed or body == self._shown:
            return
        now = time.monotonic()
        if not force and now - self._last < MIN_INTERVAL:
            return
        self._last = now
        self._shown = body
        if self._handle is not None:
            self._handle.update(_Text(body))
        else:
            self._write(body)

    def close(self, body: str | None = None) -> None:
        if body is not None:
            self.update(body, force=True)
        if not self.closed and self._handle is None and not self._terminal_lines:
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.closed = True

    def _write(self, body: str) -> None:
        if self._terminal_lines:
            sys.stdout.write(body + "\n")
        else:
            sys.stdout.write("\r" + body)
        sys.stdout.flush()


def bar(done: float, total: float, width: int = 24) -> str:
    """``[#####-------]`` for ``done`` of ``total``."""
    fill = int(width * min(1.0, done / total)) if total > 0 else width
    return "[" + "#" * fill + "-" * (width - fill) + "]"


def payload_bytes(value: Any, depth: int = 2, free: Any = None) -> int:
    """Bytes of the tensors, arrays, bytes and strings in ``value`` (looking into lists,
    tuples and dicts ``depth`` levels down): what a transfer of it moves, roughly.
    ``free(tensor)``: true for a torch tensor that moves without its bytes (by handle),
    which then counts nothing."""
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if type(value).__module__.startswith("torch") and hasattr(value, "element_size"):
        try:
            if free is not None and free(value):
                return 0
            return int(value.element_size() * value.nelement())
        except Exception:
            return 0
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if depth <= 0:
        return 0
    if isinstance(value, dict):
        return sum(payload_bytes(v, depth - 1, free) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v, depth - 1, free) for v in value)
    return 0


class Transfers:
    """The tickers of one remote cell's large transfers: ``--push`` until the worker has
    the values (its cell starts), ``--fetch`` from when the worker sends the value."""

    def __init__(self, threshold: int = LARGE_TRANSFER) -> None:
        self.open: dict[str, Ticker] = {}
        self.threshold = threshold  # bytes from which a transfer gets a ticker

    def start(self, worker: str, what: str, nbytes: int) -> None:
        if nbytes >= self.threshold:
            self.end(worker)
            self.open[worker] = Ticker(what, nbytes)

    def end(self, worker: str, ok: bool = True) -> None:
        ticker = self.open.pop(worker, None)
        if ticker is not None:
            ticker.done(ok)

    def close(self, ok: bool = True) -> None:
        for worker in list(self.open):
            self.end(worker, ok)


DELAY_ENV = "RPCNB_PROGRESS_DELAY"  # seconds a transfer runs before its bar shows


class Ticker:
    """A transfer of known size but no known progress inside it (one TensorPipe message,
    one shared-memory copy): a moving bar with the seconds so far, then its rate. It shows
    only once the transfer has taken ``RPCNB_PROGRESS_DELAY`` seconds (0.5; as tqdm's
    ``delay``): 100 MB on one host takes milliseconds, and a bar for it would cost more
    than the transfer. Its bar is drawn and moved by one thread shared by every ticker of
    the process (``_Clock``): a ticker that ends before its bar shows starts no thread,
    and its end waits for none (a thread started and joined per ticker was part of the
    1 ms or so a 100 MB push and fetch lost in alternating runs: docs/benchmarks.md)."""

    def __init__(self, what: str, nbytes: int) -> None:
        self.what = what
        self.nbytes = nbytes
        self.t0 = time.monotonic()
        self.line: Line | None = None
        self._lock = threading.Lock()
        self._stopped = False
        # the clock's thread shows the bar in the context of the code that started the
        # transfer: the cell a notebook shows it in (ipykernel keeps it in a contextvar)
        self.context = contextvars.copy_context()
        delay = settings.number(DELAY_ENV)
        if delay <= 0:
            self._show()
            if self.line is not None and self.line._handle is not None:
                _clock.add(self, self.t0 + TICK)  # a terminal shows the first and last line
        else:
            _clock.add(self, self.t0 + delay)

    def _show(self) -> None:
        with self._lock:
            if self.line is None and not self._stopped:
                self.line = Line(self._body())

    def _body(self) -> str:
        t = time.monotonic() - self.t0
        pos = int(t * 8) % 24
        moving = "-" * pos + "###" + "-" * (24 - pos)
        return f"{self.what} {text.size(self.nbytes)} [{moving[:24]}] {t:.1f} s"

    def tick(self) -> bool:
        """Due now (on the clock's thread): show the bar, or move it; whether to come
        back in ``TICK`` seconds (a bar in a notebook moves; a terminal's does not)."""
        with self._lock:
            if self._stopped:
                return False
            if self.line is None:
                self.line = Line(self._body())
            else:
                self.line.update(self._body())
            return self.line._handle is not None

    def done(self, ok: bool = True) -> None:
        with self._lock:  # after a tick() in progress: none comes after this
            self._stopped = True
            line = self.line
        _clock.remove(self)
        if line is None:  # over before its bar showed
            return
        t = max(time.monotonic() - self.t0, 1e-9)
        end = (f"{self.what} {text.size(self.nbytes)} {bar(1, 1)} {t:.1f} s, "
               f"{text.size(self.nbytes / t)}/s" if ok else f"{self.what} {text.size(self.nbytes)}: stopped")
        line.close(end)


TICK = 0.25  # seconds between two moves of a ticker's bar in a notebook


class _Clock:
    """One daemon thread that shows and moves the bars of every ticker of the process
    when each is due; made at the first ticker, it sleeps while none is waiting. The
    process's (``_clock``), for its life; a forked child starts without it (``forget``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._due: dict[Ticker, float] = {}
        self._waking: float | None = None  # when the thread wakes next (None: never)
        self._thread: threading.Thread | None = None

    def add(self, ticker: Ticker, when: float) -> None:
        with self._cond:
            self._due[ticker] = when
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rpcnb-progress",
                                                daemon=True)
                self._thread.start()
            elif self._waking is None or when < self._waking:
                self._cond.notify()  # else it wakes before this one is due anyway

    def remove(self, ticker: Ticker) -> None:
        with self._cond:  # no wake-up: the thread finds nothing due and sleeps again
            self._due.pop(ticker, None)

    def _run(self) -> None:
        # not waiting.until: it sleeps on the condition until the next bar is due, and
        # add() wakes it for an earlier one
        while True:
            with self._cond:
                now = time.monotonic()
                due = [t for t, when in self._due.items() if when <= now]
                for t in due:
                    del self._due[t]
                if not due:
                    self._waking = min(self._due.values(), default=None)
                    self._cond.wait(None if self._waking is None else self._waking - now)
                    continue
            for t in due:
                again = False
                try:
                    again = t.context.run(t.tick)
                except Exception:  # a display that failed: that bar stops, the others go on
                    pass
                if again:
                    with self._cond:
                        if not t._stopped:
                            self._due[t] = time.monotonic() + TICK

    def forget(self) -> None:
        """In a forked child: the parent's thread is not there."""
        self.__init__()  # type: ignore[misc]


_clock = _Clock()
os.register_at_fork(after_in_child=_clock.forget)


class Board:
    """One row per worker as a group starts: its state and when it got there."""

    def __init__(self, title: str, names: list[str]) -> None:
        self.title = title
        self.t0 = time.monotonic()
        self.rows: dict[str, tuple[str, float]] = {n: ("starting", 0.0) for n in names}
        self.notebook = _notebook()
        self.quiet = not self.notebook and not _terminal()  # a script piped to a file
        self.line: Line | None = None
        if not self.quiet:
            self.line = Line(self._body() if self.notebook else "", terminal_lines=True)

    def _body(self) -> str:
        rows = [("worker", "state", "seconds")]
        rows += [(n, st, f"{t:.1f}") for n, (st, t) in self.rows.items()]
        return f"{self.title}\n{text.table(rows)}"

    def set(self, name: str, state: str) -> None:
        if self.rows.get(name, ("", 0.0))[0] == state:
            return
        self.rows[name] = (state, time.monotonic() - self.t0)
        if self.line is None:
            return
        if self.notebook:
            self.line.update(self._body(), force=True)
        else:
            self.line.update(f"rpcnb: {name} {state} ({self.rows[name][1]:.1f} s)", force=True)

    def close(self, summary: str | None = None) -> None:
        """The board becomes ``summary`` in a notebook (the group table follows it)."""
        if self.line is None:
            return
        if self.notebook and summary:
            self.line.update(summary, force=True)
        self.line.closed = True
