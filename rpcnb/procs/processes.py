"""Facts about processes, and stopping them by pid: whether one runs, whether it is
stopped, its descendants, its resident memory. They come from psutil, which reads them
the same way on every Linux (and beyond), so nothing in rpcnb parses /proc for them.
``own_group`` is how rpcnb starts a child that must not get a kernel's interrupt."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import psutil


def state(pid: int) -> str | None:
    """psutil's status of ``pid`` (``"running"``, ``"sleeping"``, ``"stopped"``,
    ``"zombie"``, ...); None when it is gone."""
    try:
        return str(psutil.Process(pid).status())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def started_at(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), None when there is none:
    with the pid, what names one process for good (Linux gives pids out again)."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    return state(pid) not in (None, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def still_running(pid: int, started: float | None) -> bool:
    """Whether the process that had ``pid`` when it started at ``started`` (``started_at``)
    still runs: not a later process that got the same pid (None: the pid alone)."""
    return pid_alive(pid) and (started is None or started_at(pid) == started)


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, or held by a debugger)."""
    return state(pid) in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid``, including those in a process group of their own
    (rpcnb's workers are): what to stop by pid when a kernel goes."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def kill_all(pids: list[int]) -> None:
    """SIGKILL each pid that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of process ``pid`` (this one by default); 0 when it is gone."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


def own_group() -> dict[str, Any]:
    """``subprocess.Popen`` arguments that start a child in a process group of its own but
    in this process's session. A Jupyter kernel's interrupt is a SIGINT to the kernel's
    process group: it does not reach the child. The session is kept because Linux's
    scheduler shares the CPU between sessions (autogroup): a child in a session of its own
    (``start_new_session``) is scheduled as another program, and the kernel and its workers
    then run slower together on a busy machine (docs/benchmarks.md)."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # pragma: no cover - Python 3.10
