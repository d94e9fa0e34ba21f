"""A group's teardown as one stack: each resource registers its cleanup when it comes up
(the group's folder, the store it serves, the cell runner, the session, torch's RPC agent,
shared memory, UCX, each worker process, the death watcher), and every way out unwinds the
same stack, last in first out. Those ways are ``%rpc_shutdown``, a member leaving, a start
that fails at any step, and the kernel's exit. A restarted or added worker that fails
runs its own step early.

Like ``contextlib.ExitStack``, but a step has a name (so one worker's step can run on its
own, and a failure says which step it was), a step can ask to run after all the others
(what must happen once the group has ended, such as stopping an ipyparallel cluster), and
unwinding never raises: a step that fails is reported and the next one runs, so one stuck
resource cannot leave the rest behind.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

STEP_FAILED = "rpcnb: while leaving the group, {step} failed: {error}"


class Teardown:
    """Named cleanups, run in reverse order of registration by ``close``."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Callable[[], object]]] = []
        self._lock = threading.Lock()

    def push(self, name: str, cleanup: Callable[[], object], *, last: bool = False) -> None:
        """Register ``cleanup`` for the resource ``name`` that just came up; ``last``: run
        it after every other step (it belongs to the group's end, not to a resource)."""
        with self._lock:
            if last:
                self._steps.insert(0, (name, cleanup))
            else:
                self._steps.append((name, cleanup))

    def names(self) -> list[str]:
        """The steps still to run, in the order ``close`` runs them."""
        with self._lock:
            return [name for name, _ in reversed(self._steps)]

    def run(self, name: str) -> bool:
        """Run the steps called ``name`` now, and drop them from the stack (a worker that
        is stopped on its own); whether there was one."""
        with self._lock:
            found = [step for step in self._steps if step[0] == name]
            self._steps = [step for step in self._steps if step[0] != name]
        for step in reversed(found):
            _run(step)
        return bool(found)

    def close(self) -> None:
        """Run every step, newest first; a failing step is reported, not raised."""
        while True:
            with self._lock:
                if not self._steps:
                    return
                step = self._steps.pop()
            _run(step)


def _run(step: tuple[str, Callable[[], object]]) -> None:
    name, cleanup = step
    try:
        cleanup()
    except Exception as exc:  # the rest of the stack still runs
        print(STEP_FAILED.format(step=name, error=exc), file=sys.stderr)
