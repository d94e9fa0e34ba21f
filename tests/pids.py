"""Processes a test saw, each by its pid and when it started, so that stopping them stops
those very processes. Linux gives pids out again (32,768 of them here, and every thread
takes one too): in a suite that starts thousands of processes, three test processes side
by side, a pid noted early (a worker that has ended since) may belong to another test's
worker, kernel or server by the time it is killed. ``kill_all(p for p in pids if
pid_alive(p))`` would kill that stranger; ``Seen.kill()`` does not.

A plain module (no pytest): conftest.py, the browser server and the program baselines'
recorder (a script too) use it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from rpcnb.procs.processes import kill_all, started_at, still_running


class Seen:
    """Processes seen: pid -> when the process that had it then started. Noting a pid again
    notes the process that has it now."""

    def __init__(self, pids: Iterable[int] = ()) -> None:
        self.started: dict[int, float] = {}
        self.update(pids)

    def add(self, pid: int) -> None:
        """Note ``pid`` as the process that has it now (nothing when none has)."""
        when = started_at(pid)
        if when is not None:
            self.started[pid] = when

    def update(self, pids: Iterable[int]) -> None:
        for pid in pids:
            self.add(pid)

    def merge(self, other: Seen) -> None:
        self.started.update(other.started)

    def __ior__(self, other: Seen | Iterable[int]) -> Seen:
        """``seen |= more``: another Seen's processes as it saw them, or pids as now."""
        if isinstance(other, Seen):
            self.merge(other)
        else:
            self.update(other)
        return self

    def copy(self) -> Seen:
        return self.only(lambda _: True)

    def only(self, keep: Callable[[int], bool]) -> Seen:
        """The processes seen here whose pid ``keep`` takes."""
        new = Seen()
        new.started = {p: t for p, t in self.started.items() if keep(p)}
        return new

    def since(self, before: Seen) -> Seen:
        """The processes seen here and not in ``before``."""
        new = Seen()
        new.started = {p: t for p, t in self.started.items() if before.started.get(p) != t}
        return new

    def alive(self) -> list[int]:
        """The pids whose process is still the one seen, and runs (a zombie, dead but not
        yet reaped by its parent, does not)."""
        return sorted(p for p, t in self.started.items() if still_running(p, t))

    def kill(self) -> None:
        """SIGKILL each process seen that is still running (not a later one with its pid)."""
        kill_all(self.alive())

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.started))

    def __contains__(self, pid: object) -> bool:
        return pid in self.started

    def __len__(self) -> int:
        return len(self.started)
