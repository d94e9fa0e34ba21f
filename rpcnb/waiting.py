"""Waiting with a time limit, written once: ``until(ready, timeout)`` looks at ``ready()``
every few milliseconds until it says yes or the time is up, and a ``Deadline`` is the time
limit of a loop that does more between its looks.

Where a thread can be woken (an ``Event``, a queue, a future), it waits on that instead;
this is for what can only be looked at: a process's exit, a member in a table, a file.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

EVERY = 0.02  # seconds between two looks, unless the caller says otherwise


@dataclass(frozen=True)
class Deadline:
    """A moment on the monotonic clock (None: no limit), and how far away it is."""

    at: float | None

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        """The moment ``seconds`` from now (None: never)."""
        return cls(None if seconds is None else time.monotonic() + seconds)

    def left(self) -> float | None:
        """Seconds until it passes (0 once it has; None: no limit)."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def nap(self, seconds: float = EVERY) -> None:
        """Sleep ``seconds``, or until the deadline if that comes first."""
        left = self.left()
        time.sleep(seconds if left is None else min(seconds, left))


def until(ready: Callable[[], T], timeout: float | None, every: float = EVERY) -> T:
    """``ready()``'s first true answer, looked at every ``every`` seconds; its last (false)
    answer once ``timeout`` seconds have passed (None: no limit). ``ready`` is asked at
    least once, and once more at the deadline."""
    deadline = Deadline.after(timeout)
    while True:
        answer = ready()
        if answer or deadline.passed():
            return answer
        deadline.nap(every)
