"""Cells whose caller went away while they ran: the kernel of a kept group
(``%rpc_init --keep``) restarted, crashed or was closed while one of its cells ran here
(or waited in this member's queue). The cell runs on. What it prints from then on is kept
here instead of sent, and so is its result, until a kernel attaches to the group and
adopts it (``%rpc_init --attach``: ``rpcnb.cells.background.adopt``). The adopter is
told what the cell printed meanwhile; from then on its output goes to the adopter as any
cell's does, and its result completes the future the adopter asked for (the
``orphan_result`` request).

Bounded: a cell keeps its last ``KEEP_CHARS`` characters of output; at most
``KEEP_ENDED`` cells that ended with nobody to adopt them are kept, the oldest dropped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from rpcnb import errors
from rpcnb.cells.output import Capture, router

KEEP_ENDED = 8  # ended cells kept for an adopter, per member (the oldest go first)


@dataclass
class Orphan:
    """A cell whose caller went away: where it is, what it printed meanwhile (in its
    capture), and its result once it ends."""

    call_id: str
    caller: str  # the member that sent it (gone)
    worker: str  # this member
    cell: str  # "<worker1 cell 3>"
    source: str
    since: float  # time.time() when it began (or when it was queued, if it has not)
    capture: Capture | None = None
    ended: float | None = None  # time.time() when it ended
    wire: Any = None  # its result, as its future is completed with (CellResult.wire)
    status: str = "running"  # "done", "failed: NameError", ... once ended
    adopted_by: str = ""  # the member that adopted it ("": none, or that one went too)
    future: Any = None  # the adopter's orphan_result future

    @property
    def owner(self) -> str:
        """Whom its output and result are for now."""
        return self.adopted_by or self.caller

    def record(self) -> dict[str, Any]:
        """What the adopter is told of it (``adopt``): plain values, the output it kept so
        far, and the number of the next batch it will send (its output stays held until
        the adopter asks for its result, which it does once it can take that batch)."""
        kept, seq = self.capture.take() if self.capture is not None else ([], 0)
        return {"call_id": self.call_id, "caller": self.caller, "worker": self.worker,
                "cell": self.cell, "source": self.source, "since": self.since,
                "ended": self.ended, "status": self.status, "kept": kept, "next_seq": seq}


class Orphans:
    """This member's orphaned cells (``CellRunner.orphans``), by call id."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.lock = threading.Lock()
        self.gone: set[str] = set()  # callers that died or left while this member lived
        self.cells: dict[str, Orphan] = {}

    def caller_gone(self, name: str, job: Any, since: float) -> None:
        """``name`` died or left. The cell ``job`` that runs here now (None: none), when
        ``name`` sent it, becomes an orphan; so does every cell ``name`` had adopted.
        Their output is kept from now on."""
        with self.lock:
            self.gone.add(name)
            held = [o for o in self.cells.values() if o.owner == name]
            for o in held:
                o.adopted_by, o.future = "", None
            if job is not None and job.caller == name and job.call_id not in self.cells:
                o = self.cells[job.call_id] = Orphan(job.call_id, job.caller, self.worker,
                                                     job.filename, job.source, since)
                o.capture = router.cell_capture(job.call_id)
                held.append(o)
        for o in held:
            if o.capture is not None and o.ended is None:
                o.capture.hold()

    def caller_back(self, name: str) -> None:
        """``name`` is a member again (admitted, or restarted under that name): its cells
        from now on are not orphans."""
        with self.lock:
            self.gone.discard(name)

    def starting(self, job: Any) -> None:
        """The cell ``job`` begins (its output routed): an orphan from the start when its
        caller is gone already (a cell that waited in the queue behind one that ran on)."""
        if job.caller not in self.gone:
            return
        cap = router.opened()
        cap.hold()
        with self.lock:
            self.cells[job.call_id] = Orphan(job.call_id, job.caller, self.worker,
                                             job.filename, job.source, time.time(), cap)

    def ended(self, call_id: str, ok: bool, ename: str, wire: Any) -> None:
        """The cell ``call_id`` ended with ``wire``: kept for its adopter, or handed to it."""
        with self.lock:
            o = self.cells.get(call_id)
            if o is None:
                return
            o.ended, o.wire = time.time(), wire
            o.status = "done" if ok else f"failed: {ename}"
            future = o.future
            if future is not None:  # adopted: the adopter has it now
                del self.cells[call_id]
            ended = [c for c in self.cells.values() if c.ended is not None and not c.adopted_by]
            for old in sorted(ended, key=lambda c: c.ended or 0)[:-KEEP_ENDED]:
                del self.cells[old.call_id]
        if future is not None and not future.done():
            future.set_result(wire)

    def adopt(self, member: str) -> list[dict[str, Any]]:
        """``member`` (a kernel that attached) takes over every orphan nobody holds: it is
        told of each, with the output kept so far."""
        with self.lock:
            found = sorted((o for o in self.cells.values() if not o.adopted_by),
                           key=lambda o: o.since)
            for o in found:
                o.adopted_by = member
            return [o.record() for o in found]

    def result(self, call_id: str, member: str) -> Any:
        """The future of the adopted cell ``call_id``'s result (completed at once when it
        has ended): the ``orphan_result`` request of the member that adopted it, sent
        once it follows the cell. Its output goes to that member from now on, what it
        printed since ``adopt`` first."""
        import torch

        with self.lock:
            o = self.cells.get(call_id)
            if o is None or o.adopted_by != member:
                raise RuntimeError(errors.NO_ORPHAN.format(call_id=call_id, worker=self.worker))
            future: Any = torch.futures.Future()
            o.future = future
            if o.ended is not None:
                del self.cells[call_id]
            elif o.capture is not None:
                o.capture.resume(member)
        if o.ended is not None:
            future.set_result(o.wire)
        return future
