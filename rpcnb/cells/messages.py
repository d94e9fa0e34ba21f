"""What goes through a waiting cell's inbox, and what a worker's output is made of: one
small frozen dataclass per kind, so a reader knows what arrives by its type.

A cell's caller waits on one queue per cell (``rpcnb.cells.waiter.Call.inbox``): torch's RPC
threads put into it what the workers send (``Output``, ``Aside``, ``Ask``), a call's
future puts ``Done`` when it completes, and the session puts ``Gone`` when a worker dies
or stops answering. ``rpcnb.cells.waiter.Waiter`` takes them one at a time, by type.

Output travels between members in its wire form, ``(kind, payload)`` pairs made by
``rpcnb.cells.output.Capture`` (plain tuples keep the message on the pickler's fast path,
``rpcnb.paths.serialize.plain``); ``from_wire`` turns a batch into ``Item``\\s where it
arrives. A new kind of message is a class here, a case in ``Waiter.take`` and, for output,
a case in ``from_wire`` and in ``rpcnb.cells.printer.Printer.show``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# -- output items -------------------------------------------------------------------------

STDOUT, STDERR = "stdout", "stderr"
COMM = "comm"  # a widget's comm message (rpcnb.cells.comms)
PROGRESS = "progress"  # a transfer's stage (rpcnb.progress.Transfers)


@dataclass(frozen=True, slots=True)
class Stream:
    """Text the cell wrote to ``name`` (``stdout`` or ``stderr``)."""

    name: str
    text: str


@dataclass(frozen=True, slots=True)
class Display:
    """``display()`` / ``update_display()``: a MIME bundle (``payload``: data, metadata,
    transient, update)."""

    payload: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Clear:
    """``clear_output(wait=...)``."""

    wait: bool


@dataclass(frozen=True, slots=True)
class Comm:
    """A worker's widget talks to the front end (``rpcnb.cells.comms``)."""

    payload: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Progress:
    """A transfer's stage (``{"stage": "sending" | "received", "worker", "bytes"}``)."""

    payload: dict[str, Any]


Item = Stream | Display | Clear | Comm | Progress


def from_wire(batch: list[tuple[str, Any]]) -> list[Item]:
    """A batch as ``Capture`` sent it, as items."""
    items: list[Item] = []
    for kind, payload in batch:
        if kind == STDOUT or kind == STDERR:
            items.append(Stream(kind, payload))
        elif kind == "display":
            items.append(Display(payload))
        elif kind == "clear":
            items.append(Clear(bool(payload.get("wait", False))))
        elif kind == COMM:
            items.append(Comm(payload))
        elif kind == PROGRESS:
            items.append(Progress(payload))
        # a kind this member does not know (a newer worker's): nothing to show it with
    return items


def stream_chars(items: list[Item]) -> int:
    """How much text a batch carries."""
    return sum(len(i.text) for i in items if type(i) is Stream)


# -- a waiting cell's inbox ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Output:
    """Batch ``seq`` of ``worker``'s output for call ``call_id`` (shown in ``seq`` order)."""

    call_id: str
    worker: str
    seq: int
    items: list[Item]


@dataclass(frozen=True, slots=True)
class Aside:
    """Output outside the batches' order (a transfer's progress): shown when it arrives."""

    call_id: str
    worker: str
    items: list[Item]


@dataclass(frozen=True, slots=True)
class Done:
    """Call ``call_id``'s future completed: its result (or error) can be read."""

    call_id: str


@dataclass(frozen=True, slots=True)
class Gone:
    """``worker`` died, left or stopped answering: the waiter looks at it now rather than
    at its next turn."""

    worker: str


@dataclass(frozen=True, slots=True)
class Ask:
    """A worker asks for a line of input (``question``: a ``rpcnb.cells.console.Question``,
    answered by the thread that waits for the cell)."""

    question: Any


Message = Output | Aside | Done | Gone | Ask
