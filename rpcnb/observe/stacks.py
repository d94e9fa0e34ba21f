"""Where each member is now: ``%rpc_stacks``. Every member asked answers the ``stacks``
request (``rpcnb.membership.handlers``) on torch's RPC thread with the Python stack of each
of its threads, from ``sys._current_frames()``: so it answers also while its cell's thread
is inside a C or C++ call (``time.sleep``, a collective waiting for a rank, a long torch
op), which holds no GIL. The thread that runs a remote cell comes first, named with the
cell and since when, its frames from the cell's own on; threads of rpcnb, torch and the
kernel that wait for work are one line each; the others (a user's) in full.

The caller asks every member at once, with a short time limit, and says which one did not
answer in time, which is dead and which cannot be reached.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rpcnb import errors
from rpcnb.session import protocol, roster, state

OP = "stacks"
ASK_S = 1.0  # how long each member gets to answer

Frame = tuple[str, int, str, str]  # file, line, function, text

# where code of rpcnb, torch, the standard library and installed packages lives: a thread
# with frames from nowhere else is a helper (rpcnb's, torch's, the kernel's)
_RPCNB = str(Path(__file__).resolve().parents[1])
_LIBRARY = sorted({p for key in ("stdlib", "platstdlib", "purelib", "platlib")
                   if (p := sysconfig.get_paths().get(key))}, key=len, reverse=True)
_STDLIB = tuple(p + os.sep for key in ("stdlib", "platstdlib")
                if (p := sysconfig.get_paths().get(key)))
_PACKAGES = tuple(p + os.sep for key in ("purelib", "platlib")
                  if (p := sysconfig.get_paths().get(key)))


# -- on the member asked ---------------------------------------------------------------


def here(s: Any, full: bool = False) -> dict[str, Any]:
    """This process's threads now (what the ``stacks`` request answers): the cell's
    thread first (its frames from the cell's own frame on; ``full``: every frame), then
    the user's threads (from their first frame of the user's code on), then rpcnb's,
    torch's and the kernel's helpers."""
    runner = getattr(s, "runner", None)
    running = runner.running(stack=True) if runner is not None else None
    cell_thread = running.thread if running is not None else None
    idle_runner = runner.thread if runner is not None and running is None else None
    names = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()  # this request's own thread (an RPC thread, or the magic's)
    threads = []
    for ident, frame in list(sys._current_frames().items()):
        if ident == me:
            continue
        t = names.get(ident)
        frames = [(f.filename, f.lineno or 0, f.name, (f.line or "").strip())
                  for f in traceback.extract_stack(frame)]
        entry: dict[str, Any] = {"name": t.name if t is not None else f"thread {ident}",
                                 "ident": ident, "frames": frames,
                                 "daemon": bool(t.daemon) if t is not None else True}
        if ident == cell_thread:
            assert running is not None
            entry["kind"] = "cell"
            if not full:
                entry["frames"] = [tuple(f) for f in running.stack] or frames
        elif ident == idle_runner:
            entry["kind"] = "runner"  # the cell runner, waiting for a cell
        elif any(not _library(f[0]) for f in frames):
            entry["kind"] = "user"
            if not full:
                entry["frames"] = _from_user_code(frames)
        else:
            entry["kind"] = "idle"
        threads.append(entry)
    order = {"cell": 0, "user": 1, "runner": 2, "idle": 3}
    threads.sort(key=lambda e: (order[e["kind"]], e["name"]))
    found = None
    if running is not None:
        found = dataclasses.asdict(running)
        found.pop("stack")
    return {"name": s.name, "pid": os.getpid(), "running": found, "threads": threads}


def _library(filename: str) -> bool:
    """Whether a frame's file is rpcnb's, the standard library's or an installed
    package's (not the user's: a cell, the notebook, a script, the user's own modules)."""
    if filename.startswith("<frozen ") or filename.startswith(_RPCNB + os.sep):
        return True
    return any(filename.startswith(p + os.sep) for p in _LIBRARY)


def _from_user_code(frames: list[Frame]) -> list[Frame]:
    """A user's thread from its first frame of the user's code on: without threading's
    bootstrap, or the kernel's event loop around a notebook cell (``full`` keeps them)."""
    first = next(i for i, f in enumerate(frames) if not _library(f[0]))
    return frames[first:]


# -- on the caller -----------------------------------------------------------------------


@dataclass
class MemberStacks:
    """One member's answer: its threads, or why there is none (``state``: "answered",
    "dead", "unreachable", "silent")."""

    name: str
    state: str
    how: str = ""  # how it died, since when it is unreachable, why it did not answer
    seconds: float = 0.0  # how long its answer took
    pid: int | None = None
    running: dict[str, Any] | None = None
    threads: list[dict[str, Any]] = field(default_factory=list)
    full: bool = False  # every thread in full, the idle ones too

    def text(self) -> str:
        if self.state == "dead":
            return errors.STACKS_DEAD.format(name=self.name, how=self.how)
        if self.state == "unreachable":
            return errors.STACKS_UNREACHABLE.format(name=self.name, since=self.how)
        if self.state == "silent":
            return errors.STACKS_SILENT.format(name=self.name, seconds=self.how)
        lines = []
        idle: list[dict[str, Any]] = []
        for t in self.threads:
            kind = t["kind"]
            if kind in ("runner", "idle") and not self.full:
                idle.append(t)
                continue
            head = f"{self.name}, thread {t['name']}"
            r = self.running
            if kind == "cell" and r is not None:
                head += (f": running {r['cell']} since {_clock(r['since'])} ({r['seconds']:.1f} s), "
                         f"sent by {r['caller']}")
            lines.append(head + ":")
            lines.extend(_frames(t["frames"]))
        if self.running is None:
            lines.insert(0, f"{self.name}: {errors.STACKS_IDLE}")
        if idle:
            lines.append(f"{self.name}, {len(idle)} idle threads (rpcnb, torch, the kernel):")
            lines.extend(_compact(idle))
        return "\n".join(lines)


@dataclass
class Stacks:
    """What ``%rpc_stacks`` shows: each member's threads now; ``print()`` it."""

    me: str
    members: list[MemberStacks]
    seconds: float  # how long asking every member took

    def get(self, name: str) -> MemberStacks:
        return next(m for m in self.members if m.name == name)

    def __str__(self) -> str:
        return "\n\n".join(m.text() for m in self.members)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def stacks(workers: list[str] | None = None, *, every: bool = False, full: bool = False,
           timeout: float = ASK_S) -> Stacks:
    """Each member's Python stack of every thread, now (``%rpc_stacks``).

    Args:
        workers: the members to ask, by name (default: every member but this process;
            the dead ones are named as dead).
        every: also this process (``--all``).
        full: every frame of every thread: rpcnb's frames around a cell, and the
            helper threads' whole stacks.
        timeout: seconds each member gets to answer; one that does not is named.

    Returns:
        A ``Stacks``; ``print()`` it.

    Raises:
        rpcnb.RpcnbError: this process is in no group; a name that is no member.
        ValueError: ``timeout`` not above 0.
    """
    if not timeout > 0:
        raise ValueError(errors.STACKS_BAD_TIMEOUT.format(timeout=timeout))
    s = state.current()
    t0 = time.perf_counter()
    workers = roster.expand(s, workers) if workers else None  # a worker set: worker1-8
    live = roster.live_names(s)
    dead, unreachable = s.dead(), s.unreachable()
    if workers:
        names: list[str] = []
        for name in workers:
            if name not in live and name not in dead:
                raise errors.RpcnbError(errors.UNKNOWN_WORKER.format(
                    name=name, known=", ".join(live)))
            if name not in names:
                names.append(name)
    else:
        names = [n for n in live if n != s.name or every] + [n for n in dead if n not in live]
        if not names:
            raise errors.RpcnbError(errors.NO_WORKERS)
    asked: dict[str, tuple[float, Any]] = {}
    found: dict[str, MemberStacks] = {}
    for name in names:
        if name in dead:
            found[name] = MemberStacks(name, "dead", dead[name])
        elif name in unreachable:
            found[name] = MemberStacks(name, "unreachable", _clock(unreachable[name]))
        elif name != s.name:
            try:
                asked[name] = (time.perf_counter(), protocol.call_async(
                    s.token, name, OP, full, timeout=timeout))
            except Exception as exc:
                found[name] = MemberStacks(name, "silent", _why(exc, timeout))
    if s.name in names:  # this process: no request needed
        found[s.name] = _answered(s.name, here(s, full), 0.0, full)
    for name, (start, fut) in asked.items():
        try:
            answer = fut.wait()
        except Exception as exc:
            how = s.how_gone(name)
            found[name] = MemberStacks(name, "dead", how) if how is not None else \
                MemberStacks(name, "silent", _why(exc, timeout))
            continue
        found[name] = _answered(name, answer, time.perf_counter() - start, full)
    return Stacks(s.name, [found[n] for n in names], time.perf_counter() - t0)


def _answered(name: str, answer: dict[str, Any], seconds: float, full: bool) -> MemberStacks:
    return MemberStacks(name, "answered", seconds=seconds, pid=answer.get("pid"),
                        running=answer.get("running"), threads=answer.get("threads", []),
                        full=full)


def _why(exc: BaseException, timeout: float) -> str:
    said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"{timeout:g} s" if "timed out" in said.lower() or "timeout" in said.lower() \
        else f"{timeout:g} s ({said})"


def _clock(when: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when))


def _short(filename: str) -> str:
    """A library file as its path inside the library (``torch/distributed/rpc/api.py``)."""
    if filename.startswith(_RPCNB + os.sep):
        return "rpcnb" + filename[len(_RPCNB):]
    for p in _LIBRARY:
        if filename.startswith(p + os.sep):
            return filename[len(p) + 1:]
    return filename


def _frames(frames: list[Frame]) -> list[str]:
    """Frames as a traceback shows them, outermost first."""
    lines = []
    for file, line, func, text in frames:
        lines.append(f'  File "{file}", line {line}, in {func}')
        if text:
            lines.append(f"    {text}")
    return lines


def _compact(threads: list[dict[str, Any]]) -> list[str]:
    """Helper threads, one line per place they wait (threads waiting at the same place
    together): the innermost frame outside the standard library, and what it calls."""
    places: dict[str, list[str]] = {}
    for t in threads:
        frames = t["frames"]
        outside = [f for f in frames if not f[0].startswith(_STDLIB)
                   or f[0].startswith(_PACKAGES)] or frames
        if not frames:
            place = "(no Python frame)"
        else:
            file, line, func, _ = outside[-1]
            place = f"{func} ({_short(file)}:{line})"
            if outside[-1] is not frames[-1]:
                place += f" in {frames[-1][2]}"
        if t["kind"] == "runner":
            place = "waits for a cell (rpcnb's cell runner)"
        places.setdefault(place, []).append(t["name"])
    return [f"  {', '.join(names) if len(names) <= 3 else f'{len(names)} threads'}: {place}"
            for place, names in places.items()]
