"""Kept groups: groups whose workers outlive the kernel that started them (``%rpc_init
--keep``), and the user's registry of them.

A kept group's first member is not the kernel but a process of its own, the keeper
(``python -m rpcnb.keeper``, started in a session of its own, so neither a kernel restart
nor its process group's SIGKILL reaches it). It holds the rendezvous, starts and watches
the workers, runs no cells, and ends the group when no kernel has been attached for its
idle limit. A kernel attaches by joining the group (``rpcnb.attach``).

Each kept group has a folder in the user's private runtime directory
(``rpcnb.sandbox.isolation.runtime_dir()/kept/NAME``, mode 0700) holding its ``record.json``
(mode 0600: where the group's connection file is, the keeper's and the workers' pids,
since when, which kernel is attached, since when none is) and the keeper's log. Only the
user can read it, and the group's secret stays in its 0600 connection file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from rpcnb import errors, waiting
from rpcnb.errors import RpcnbError
from rpcnb.procs.processes import pid_alive, still_running
from rpcnb.sandbox import isolation

if TYPE_CHECKING:
    from rpcnb.observe.doctor import Finding

KEEPER = "keeper"  # the keeper's name in its group
DOCTOR_MEMBER = "kept"  # %rpc_doctor's findings on kept groups are under this name
DEFAULT_KEEP_S = 3600.0  # --keep without a duration: an hour without a kernel
START_S = 180.0  # seconds a keeper gets to start its group (workers included)
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d)?\Z")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def this_is_the_keeper() -> bool:
    """Whether this process is a kept group's keeper (``python -m rpcnb.keeper``): its
    runner is of kind ``keeper`` from the start, so every member leaves it out of what it
    waits for (``--all``, torch's all-gather and barriers)."""
    import sys

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "rpcnb.keeper"


def duration(text: str | float | None) -> float:
    """``--keep``'s value in seconds: ``90``, ``90s``, ``30m``, ``2h``, ``1d`` (None or
    empty: the default hour). ValueError for anything else."""
    if text is None or text == "":
        return DEFAULT_KEEP_S
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        m = _DURATION.match(str(text).strip())
        if m is None:
            raise ValueError(errors.KEEP_DURATION.format(value=text))
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not seconds > 0:
        raise ValueError(errors.KEEP_DURATION.format(value=text))
    return seconds


@dataclass
class Record:
    """What the registry knows of one kept group (its ``record.json``)."""

    name: str
    keep_s: float
    pid: int = 0  # the keeper's
    started: float = 0.0  # when the keeper started: the process with that pid now may not be it
    since: float = field(default_factory=time.time)
    connection: str = ""  # the group's connection file, once it is up
    workers: dict[str, int] = field(default_factory=dict)  # name -> pid
    dead: dict[str, str] = field(default_factory=dict)  # name -> how it died
    attached: str = ""  # the kernel attached now, "" for none
    attached_pid: int = 0
    idle_since: float | None = None  # since when no kernel is attached
    failed: str = ""  # why the keeper could not start the group
    group_id: str = ""  # the group's id (its /dev/shm segments are named after it)
    folder: str = ""  # the group's own folder (its store, its connection file)
    # name -> what the keeper last heard of its memory (``view.memory_info``: rss, shm,
    # gpu, as %rpc_workers shows it), the keeper's own rss under its name; {} before
    memory: dict[str, dict[str, Any]] = field(default_factory=dict)

    def alive(self) -> bool:
        """Whether the keeper runs: its pid, held by the process that started then (a
        keeper that was killed leaves its record, and its pid to a later process)."""
        return self.pid > 0 and still_running(self.pid, self.started or None)


def root() -> Path:
    """The user's folder of kept groups (made 0700)."""
    path = isolation.runtime_dir() / "kept"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def folder(name: str) -> Path:
    return root() / name


def write(rec: Record) -> None:
    """Write ``rec`` atomically, readable by this user only."""
    path = folder(rec.name)
    path.mkdir(mode=0o700, exist_ok=True)
    tmp = path / "record.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(rec), f)
    os.replace(tmp, path / "record.json")


def read(name: str) -> Record | None:
    try:
        data = json.loads((folder(name) / "record.json").read_text())
        # a field a newer keeper writes is left out: its group is not taken for a broken one
        known = {f.name for f in fields(Record)}
        return Record(**{k: v for k, v in data.items() if k in known})
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def remove(name: str) -> None:
    shutil.rmtree(folder(name), ignore_errors=True)


def groups() -> list[Record]:
    """The user's kept groups whose keeper runs; a folder whose keeper is gone is removed
    (a keeper killed by SIGKILL could not remove its own)."""
    found = []
    for path in sorted(root().iterdir()):
        rec = read(path.name)
        if rec is None or not rec.alive():
            starting = rec is not None and not rec.pid and time.time() - rec.since < START_S
            if not starting:
                shutil.rmtree(path, ignore_errors=True)
            continue
        found.append(rec)
    return found


def new_name() -> str:
    taken = {p.name for p in root().iterdir()}
    return next(f"group{i}" for i in range(1, len(taken) + 2) if f"group{i}" not in taken)


def find(name: str | None) -> Record:
    """The kept group ``name`` (None: the one there is), or RpcnbError saying which exist."""
    kept = groups()
    if name:
        for rec in kept:
            if rec.name == name:
                return rec
        raise RpcnbError(errors.KEPT_UNKNOWN.format(
            name=name, known=", ".join(r.name for r in kept) or "none"))
    if not kept:
        raise RpcnbError(errors.KEPT_NONE)
    if len(kept) > 1:
        raise RpcnbError(errors.KEPT_WHICH.format(known=", ".join(r.name for r in kept)))
    return kept[0]


def spawn(name: str, workers: int, keep_s: float, init_kwargs: dict[str, Any]) -> Record:
    """Start the keeper of a new kept group and wait until its group is up (its record
    names the connection file); RpcnbError with the end of its log if it fails."""
    rec = Record(name=name, keep_s=keep_s)
    write(rec)
    log = folder(name) / "keeper.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rpcnb.keeper", "--group", name, "--workers", str(workers),
             "--keep", str(keep_s), "--options", json.dumps(init_kwargs)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True)
    def up_or_failed() -> bool:
        now = read(name)
        return (now is not None and bool(now.connection or now.failed)) or proc.poll() is not None

    waiting.until(up_or_failed, START_S, every=0.1)
    now = read(name)
    if now is None or not now.connection:
        with contextlib.suppress(Exception):
            proc.kill()
        tail = log_tail(name)
        remove(name)
        raise RpcnbError(errors.KEEPER_FAILED.format(
            reason=(now.failed if now is not None and now.failed else "it did not start in "
                    f"{START_S:g} s"), log=tail))
    return now


def log_tail(name: str, lines: int = 15) -> str:
    try:
        text = (folder(name) / "keeper.log").read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def end(name: str, timeout: float = 15.0) -> bool:
    """Ask the keeper of ``name`` to end its group (SIGTERM) and wait for it; it is
    killed, and its workers with it, after ``timeout``. Whether it was running."""
    rec = read(name)
    if rec is None or not rec.alive():
        remove(name)
        return False
    try:
        keeper = psutil.Process(rec.pid)
        # its workers, as the keeper's descendants now (a pid of the record whose worker
        # ended may be another process's by now); a psutil.Process is its pid and its start
        # time, so no signal below reaches a later process that got one of these pids
        workers = [p for p in keeper.children(recursive=True) if p.pid in rec.workers.values()]
        keeper.terminate()
    except psutil.NoSuchProcess:  # it ended just now
        remove(name)
        return True
    # not psutil.wait_procs: a process that is not our child and ended counts as running
    # there until its parent reaps it, which a kernel that started a keeper may never do
    if not waiting.until(lambda: not rec.alive(), timeout, every=0.05):
        for p in [keeper, *workers]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    waiting.until(lambda: not any(_runs(p) for p in workers), 5.0, every=0.05)
    remove(name)
    return True


def _runs(p: psutil.Process) -> bool:
    """Whether the process ``p`` (a psutil.Process) still runs: not ended, not a zombie."""
    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def claim(rec: Record) -> Path:
    """This process is the one attaching to ``rec``: its pid in the group's
    ``attached.pid``, made exclusively; RpcnbError naming the kernel that is attached
    (or attaching) while that one lives. A claim of a process that is gone is taken over."""
    path = folder(rec.name) / "attached.pid"
    me = os.getpid()
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            try:
                holder = int(path.read_text().strip() or 0)
            except (OSError, ValueError):
                holder = 0
            if holder and holder != me and pid_alive(holder):
                now = read(rec.name) or rec
                kernel = now.attached if now.attached_pid == holder and now.attached else \
                    f"the kernel of pid {holder}"
                raise RpcnbError(errors.KEPT_ATTACHED.format(
                    group=rec.name, kernel=kernel, pid=holder)) from None
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(me))
        return path
    raise RpcnbError(errors.KEPT_ATTACHED.format(group=rec.name, kernel="another kernel",
                                                 pid="?"))


def claimed(name: str) -> str:
    """The kernel that holds the claim on ``name`` ("pid N"; "" for none alive): attached
    before the keeper's record says so (it looks every second)."""
    try:
        holder = int((folder(name) / "attached.pid").read_text().strip() or 0)
    except (OSError, ValueError):
        return ""
    return f"kernel_{holder}" if holder and pid_alive(holder) else ""


def release(name: str, path: Path) -> None:
    """Give up this process's claim on the kept group ``name`` (it left, or failed to)."""
    with contextlib.suppress(OSError, ValueError):
        if int(path.read_text().strip() or 0) == os.getpid():
            path.unlink()


def report(rec: Record, view: Any, seconds: float) -> str:
    """What the kernel that attached is told: the workers it found (busy ones with their
    cell), the ones that died meanwhile, and what did not survive the kernel before."""
    workers = [m for m in view.members if m.kind not in ("kernel", KEEPER)]
    lines = [errors.KEPT_ATTACHED_TO.format(
        group=rec.name, seconds=seconds, workers=", ".join(m.name for m in workers) or "none",
        idle=_ago(rec.idle_since))]
    for m in workers:
        busy = getattr(m, "busy", None)
        if busy:
            lines.append(errors.KEPT_BUSY.format(
                worker=m.name, cell=busy.get("cell", "a cell"), seconds=busy.get("seconds", 0)))
    for name, how in sorted((read(rec.name) or rec).dead.items()):
        lines.append(errors.KEPT_DIED.format(worker=name, how=how))
    lines.append(errors.KEPT_NOT_KEPT)
    return "\n".join(lines)


def _ago(since: float | None) -> str:
    if since is None:
        return "a kernel was attached until now"
    return f"no kernel attached for {max(0.0, time.time() - since):.0f} s"


def memory_bytes(rec: Record) -> int | None:
    """The resident memory of the keeper and the live workers, as the keeper last heard
    it (None before it asked)."""
    if not rec.memory:
        return None
    return sum(int(m.get("rss", 0)) for n, m in rec.memory.items()
               if n == KEEPER or n in rec.workers)


def gpu_memory(rec: Record) -> dict[str, list[dict[str, Any]]] | None:
    """Each live worker's CUDA memory (``machine.gpu_memory``'s list; empty without a GPU),
    as the keeper last heard it (None before it asked)."""
    if not rec.memory:
        return None
    return {n: list(rec.memory[n].get("gpu") or []) for n in rec.workers if n in rec.memory}


def gpu_text(rec: Record) -> str:
    """The GPU memory column: ``no GPU``, or each worker's ``worker1 cuda:0 1.2 GB alloc /
    2.0 GB reserved / 79.6 GB``; ``-`` before the keeper asked."""
    from rpcnb.session.members import gpu_memory as said

    gpus = gpu_memory(rec)
    if gpus is None:
        return "-"
    if not any(gpus.values()):
        return "no GPU"
    return "; ".join(f"{n} {said({'gpu': g})}" for n, g in gpus.items() if g)


def attached(rec: Record) -> str:
    """The kernel attached to ``rec`` (its name in the group), "" for none. A kernel that
    has ended is not attached, also in the second before the keeper's record says so."""
    if rec.attached and (not rec.attached_pid or pid_alive(rec.attached_pid)):
        return rec.attached
    return claimed(rec.name)


def idle_since(rec: Record) -> float | None:
    """Since when no kernel has been attached to ``rec`` (None while one is); a kernel
    that ended in the second before the keeper's record says so ended about now."""
    if attached(rec):
        return None
    return time.time() if rec.idle_since is None else rec.idle_since


def mine(rec: Record) -> bool:
    """Whether this process is the kernel attached to ``rec``."""
    from rpcnb.session import state

    s = state.active()
    return s is not None and s.kept_group == rec.name


def describe(rec: Record) -> dict[str, Any]:
    """One kept group as plain data (the panel's ``kept`` rows; docs/panel.md)."""
    return {"name": rec.name, "pid": rec.pid, "workers": list(rec.workers),
            "dead": dict(rec.dead), "since": rec.since, "attached": attached(rec),
            "idle_since": idle_since(rec), "keep_s": rec.keep_s,
            "memory": memory_bytes(rec), "gpu": gpu_memory(rec), "mine": mine(rec)}


def idle_text(rec: Record, now: float | None = None) -> str:
    """``42 s of 3600 s``: how long no kernel has been attached, of the idle limit."""
    now = time.time() if now is None else now
    since = idle_since(rec)
    idle = 0.0 if since is None else max(0.0, now - since)
    return f"{idle:.0f} s of {rec.keep_s:g} s"


def findings(recs: list[Record] | None = None) -> list[Finding]:
    """``%rpc_doctor``'s findings on the user's kept groups (``groups()`` by default), one
    per group under the member ``kept``: its keeper and workers, and the kernel attached
    or for how long none has been, of its limit (a note: it holds its workers' memory);
    a worker that died is a problem."""
    from rpcnb.observe.doctor import Finding

    out = []
    for rec in groups() if recs is None else recs:
        kernel = attached(rec)
        if kernel:
            now = f"attached: {kernel}" + (" (this kernel)" if mine(rec) else "")
        else:
            left = rec.keep_s - (time.time() - (rec.idle_since or time.time()))
            now = (f"no kernel attached for {idle_text(rec)} (it ends by itself in "
                   f"{max(0.0, left):.0f} s)")
        detail = f"keeper pid {rec.pid}, workers {', '.join(rec.workers) or 'none'}; {now}"
        if rec.dead:
            detail += "; dead: " + ", ".join(f"{n} ({how})" for n, how in sorted(rec.dead.items()))
            out.append(Finding(DOCTOR_MEMBER, rec.name, "warn", detail,
                               errors.KEPT_DEAD_TODO.format(group=rec.name)))
        elif kernel:
            out.append(Finding(DOCTOR_MEMBER, rec.name, "ok", detail))
        else:
            out.append(Finding(DOCTOR_MEMBER, rec.name, "note", detail,
                               errors.KEPT_IDLE_TODO.format(group=rec.name)))
    return out


def table(recs: list[Record]) -> str:
    """``%rpc_groups``: one line per kept group."""
    from rpcnb.text import size
    from rpcnb.text import table as text_table

    if not recs:
        return errors.KEPT_NONE_LISTED
    rows = [("group", "keeper pid", "workers", "since", "attached", "idle for", "memory",
             "gpu memory")]
    for r in recs:
        mem, kernel = memory_bytes(r), attached(r)
        workers = ", ".join(r.workers) + (f" (dead: {', '.join(r.dead)})" if r.dead else "")
        rows.append((r.name, str(r.pid), workers or "none",
                     time.strftime("%H:%M:%S", time.localtime(r.since)),
                     kernel or "no", "-" if kernel else idle_text(r),
                     "-" if mem is None else size(mem), gpu_text(r)))
    return text_table(rows)
