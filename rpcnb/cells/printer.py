"""Where a remote cell was asked for: ``Printer`` writes each batch of a worker's output
into the cell (rpcnb.cells.output captures it where the cell runs). With several workers
each line is prefixed with its worker's name, and a line being rewritten (a progress bar)
gets a region of its own per worker in a notebook, updated in place, so two workers' bars
show as two moving lines.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, ClassVar

from rpcnb.cells.messages import Clear, Comm, Display, Item, Progress, Stream
from rpcnb.cells.output import shell


def visible(line: str) -> str:
    """What a terminal shows of one line (no ``\n``): the part after its last ``\r``."""
    core = line.rstrip("\r")
    return core[core.rfind("\r") + 1:]


def _in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (displays can be updated in place)."""
    sh = shell()
    return sh is not None and getattr(sh, "kernel", None) is not None


def write_lines(name: str, text: str) -> None:
    """Another member's output into this process's ``name`` stream, between its lines."""
    out = sys.stdout if name == "stdout" else sys.stderr
    getattr(out, "write_lines", out.write)(text)


class Printer:
    """Writes worker output into this process's cell, prefixed per line when several run.

    With ``prefix``, a line still being written when its batch arrives is held until it
    ends, except a line rewritten with carriage returns (a progress bar): in a notebook it
    gets a region of its own per worker and stream (a display updated in place, marked with
    the worker's name), which keeps the line once it ends; elsewhere only ended lines are
    written. ``on_comm``: who takes a worker's widget messages (``rpcnb.cells.comms.relay``,
    which sits above this module)."""

    def __init__(self, prefix: bool, on_comm: Callable[[str, dict[str, Any]], None] | None
                 = None) -> None:
        self.prefix = prefix
        self.on_comm = on_comm
        self.partial: dict[tuple[str, str], str] = {}
        self.live: dict[tuple[str, str], Any] = {}  # the region of a line being rewritten
        self.regions = prefix and _in_kernel()
        self.wrote = False
        self.on_progress: Any = None  # called with a "progress" item's payload

    def stream(self, worker: str, name: str, text: str) -> None:
        self.wrote = True
        if not self.prefix:
            write_lines(name, text)
            return
        key = (worker, name)
        buf = self.partial.get(key, "") + text
        *lines, rest = buf.split("\n")
        self.partial[key] = rest
        if lines and key in self.live:  # the rewritten line ended: its region keeps it
            self._show(key, visible(lines.pop(0)))
            del self.live[key]
        if lines:
            write_lines(name, "".join(f"[{worker}] {visible(line)}\n" for line in lines))
        if rest and self.regions and (key in self.live or "\r" in rest):
            self._show(key, visible(rest))

    def _show(self, key: tuple[str, str], line: str) -> None:
        """The region of ``key``'s line being rewritten shows ``line`` (made at its first)."""
        from IPython.display import display

        body = {"text/plain": f"[{key[0]}] {line}"}
        handle = self.live.get(key)
        if handle is None:
            self._flush_streams()  # what was written before the line stays above it
            self.live[key] = display(body, raw=True, display_id=True)
        else:
            handle.update(body, raw=True)

    @staticmethod
    def _flush_streams() -> None:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass

    def _display(self, worker: str, item: Display) -> None:
        payload = item.payload
        self.wrote = True
        if shell() is None:
            print(payload["data"].get("text/plain", ""))
            return
        from IPython.display import publish_display_data

        publish_display_data(payload["data"], payload.get("metadata") or None,
                             transient=payload.get("transient") or None,
                             update=payload.get("update", False))

    def _clear(self, worker: str, item: Clear) -> None:
        self.wrote = True
        if shell() is not None:
            from IPython.display import clear_output

            clear_output(wait=item.wait)

    def _comm(self, worker: str, item: Comm) -> None:
        """A worker's widget talks to the front end (rpcnb.cells.comms)."""
        if self.on_comm is not None:
            self.on_comm(worker, item.payload)

    def _progress(self, worker: str, item: Progress) -> None:
        """A transfer's stages (rpcnb.progress.Transfers)."""
        if self.on_progress is not None:
            self.on_progress(item.payload)

    def _stream(self, worker: str, item: Stream) -> None:
        self.stream(worker, item.name, item.text)

    SHOWS: ClassVar[dict[type, Callable[[Printer, str, Any], None]]] = {
        Stream: _stream, Display: _display, Clear: _clear, Comm: _comm, Progress: _progress}

    def show(self, worker: str, items: list[Item]) -> None:
        """One batch of ``worker``'s output, in order."""
        for item in items:
            self.SHOWS[type(item)](self, worker, item)

    def finish(self) -> None:
        for (worker, name), rest in self.partial.items():
            if (worker, name) in self.live:
                if visible(rest):
                    self._show((worker, name), visible(rest))
            elif rest:
                write_lines(name, f"[{worker}] {visible(rest)}\n")
                self.wrote = True
        self.partial.clear()
        self.live.clear()
        if not self.wrote:
            # ipykernel gives every thread that flushes a socket of its own (closed 10 s
            # after the thread ends): many short threads calling rpcnb.run would pile them up
            return
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
