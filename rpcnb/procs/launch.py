"""How worker processes come to exist: forked by this kernel's warm launcher.

The first ``%rpc_init --workers N`` starts the launcher (``rpcnb.procs.forkserver``: a Python
that imports torch and rpcnb's worker once, in a process group of its own) before the kernel
imports torch itself, so the two imports overlap; it stays after ``%rpc_shutdown``, so a
later group, ``--add`` and ``%rpc_restart`` get workers forked in a fraction of a second.
Each worker is ``rpcnb.worker.main()`` in a process group of its own (so a kernel interrupt
is not also delivered to it) but in the kernel's session (``rpcnb.procs.processes.own_group``), with
stdout and stderr in a log file under the group's directory.
The launcher talks to this process only through its pipes, ends when this process ends
(``stop_launcher`` at exit, or its pipe closing when this process is killed), and its
workers end with it. Facts about processes (liveness, descendants, memory) are
``rpcnb.procs.processes``.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rpcnb.procs.processes import is_stopped, own_group, started_at, still_running
from rpcnb.waiting import Deadline

# Environment every rpcnb process gets unless the user set it already.
QUIET_ENV = {
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # TensorPipe's "eof" warning on every graceful leave
    "TP_SOCKET_IFNAME": "lo",  # TensorPipe listens on loopback only
}


def apply_quiet_env(env: dict[str, str] | None = None) -> dict[str, str]:
    target = os.environ if env is None else env
    for key, value in QUIET_ENV.items():
        target.setdefault(key, value)
    return dict(target)


def how_died(returncode: int | None) -> str:
    """'killed by SIGKILL', 'exited with code 1', ... in words."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


# Variables a Python, torch or its libraries read when they load (the interpreter's
# path, torch's log level, OpenMP and BLAS): a launcher started under other values would
# fork workers unlike fresh processes, so it is replaced when one of them changed here.
# The others (CUDA_VISIBLE_DEVICES, TP_SOCKET_IFNAME, ...) are read later and each worker
# gets this process's values when it is forked.
LOAD_TIME_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_",
                      "OPENBLAS")
# the launcher forks the worker's program, named here (rpcnb.procs imports nothing above it)
LAUNCHER_CMD = "from rpcnb.procs.forkserver import main; main('rpcnb.worker')"
FORK_TIMEOUT = 120.0  # the launcher's imports on a loaded machine, then one fork
LOST = 255  # the return code of a worker whose launcher ended before it did

LAUNCHER_DIED = "the warm launcher (pid {pid}) {how} before it could start the worker"


class LauncherFailed(RuntimeError):
    """The launcher could not start a worker: it ended (what it printed is in the message)
    or did not answer in time."""


def load_time_env(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME_PREFIXES)}


class ForkedProcess:
    """A worker the launcher forked: the part of ``subprocess.Popen`` rpcnb uses. Its exit
    status comes from the launcher, which reaps it; signals go through the launcher too,
    which sends them only to a child it has not reaped (never to a reused pid)."""

    def __init__(self, launcher: Launcher, pid: int) -> None:
        self.pid = pid
        # read while the launcher has not reaped it: with the pid, this very process (an
        # orphan's pid may be another process's once it has ended)
        self.started = started_at(pid)
        self.returncode: int | None = None
        self.lost = False  # ended after its launcher: no exit status
        self._launcher = launcher
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def running(self) -> bool:
        """Whether this process runs: its pid, held by the process that started then."""
        return still_running(self.pid, self.started)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._launcher.signal(self, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def ended(self, code: int, lost: bool = False) -> None:
        self.lost = lost
        self.returncode = code
        self._ended.set()


def _watch_orphans(orphans: list[ForkedProcess]) -> None:
    """Workers whose launcher is gone: each ends (LOST, no exit status) when its pid does."""
    while orphans:
        for child in [c for c in orphans if not c.running()]:
            child.ended(LOST, lost=True)
            orphans.remove(child)
        time.sleep(0.2)


class Launcher:
    """This process's warm launcher (``rpcnb.procs.forkserver``): a Python in a process group
    of its own that has imported torch, forking workers on request. It is reached only through
    its pipes; a thread reads its answers and the exits of its workers."""

    def __init__(self) -> None:
        env = apply_quiet_env(dict(os.environ))
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # no CUDA context before a fork
        self.load_env = load_time_env(os.environ)
        self._err = tempfile.TemporaryFile(prefix="rpcnb-launcher-")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER_CMD], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._err, env=env, **own_group())
        self.pid = self.proc.pid
        self.facts: dict[str, Any] = {}  # what it said when it was ready
        self.forked = 0  # workers it started
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._gone = False
        self._write_lock = threading.Lock()
        threading.Thread(target=self._read, name="rpcnb-launcher", daemon=True).start()

    def alive(self) -> bool:
        return not self._gone and self.proc.poll() is None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "exit" in msg:
                    child = self._children.pop(msg["exit"], None)
                    if child is not None:
                        child.ended(msg["code"])
                elif msg.get("ready"):
                    self.facts = msg
                elif "id" in msg:
                    if "pid" in msg:  # before its exit can be read
                        msg["proc"] = self._children[msg["pid"]] = ForkedProcess(self, msg["pid"])
                        self.forked += 1
                    self._replies[msg["id"]] = msg
                self._cond.notify_all()
        with self._cond:
            self._gone = True
            orphans = list(self._children.values())
            self._children.clear()
            self._cond.notify_all()
        # Its workers stay (they watch the kernel, not it); their exit status goes with
        # it, so each is watched by pid from now on.
        if orphans:
            threading.Thread(target=_watch_orphans, args=(orphans,), daemon=True,
                             name="rpcnb-orphans").start()

    def _send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        with self._write_lock:
            try:
                self.proc.stdin.write((json.dumps(msg) + "\n").encode())
                self.proc.stdin.flush()
            except (OSError, ValueError):  # it is gone; the caller finds out from _ask
                pass

    def _ask(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        rid = msg["id"] = next(self._ids)
        self._send(msg)
        deadline = Deadline.after(timeout)
        with self._cond:
            # not waiting.until: it sleeps on the condition that the reader thread notifies
            # (a reply, or the launcher gone)
            while rid not in self._replies:
                left = deadline.left()
                if self._gone or not left:
                    raise LauncherFailed(self.why_failed())
                self._cond.wait(min(left, 0.5))
            return self._replies.pop(rid)

    def why_failed(self) -> str:
        """Why it did not answer: how it ended and the end of what it printed."""
        try:
            self.proc.wait(1)
            how = how_died(self.proc.returncode)
        except subprocess.TimeoutExpired:
            how = "did not answer"
        self._err.seek(0)
        tail = self._err.read()[-3000:].decode(errors="replace").rstrip()
        text = LAUNCHER_DIED.format(pid=self.pid, how=how)
        return text + (":\n" + tail if tail else "")

    def fork(self, argv: list[str], secret: str, env: dict[str, str], log: Path,
             title: str, timeout: float = FORK_TIMEOUT) -> ForkedProcess:
        """A worker process running ``rpcnb.worker.main(argv)`` with the group's secret,
        ``env`` as its whole environment, this process's working directory, stdout and
        stderr in ``log``. Waits for the launcher's imports on its first use."""
        reply = self._ask({"op": "fork", "argv": argv, "secret": secret, "env": env,
                           "cwd": os.getcwd(), "log": str(log), "title": title}, timeout)
        proc: ForkedProcess = reply["proc"]
        return proc

    def signal(self, child: ForkedProcess, sig: int) -> None:
        """``sig`` to a worker it forked: through the launcher (which signals only a child
        it has not reaped), or, the launcher gone, to the orphan while it is that process."""
        if self.alive():
            self._send({"op": "signal", "pid": child.pid, "sig": sig})
        elif child.running():
            try:
                os.kill(child.pid, sig)
            except ProcessLookupError:
                pass

    def ask_facts(self, timeout: float = FORK_TIMEOUT) -> dict[str, Any]:
        """CUDA and threads in the launcher, as it sees them now."""
        return dict(self._ask({"op": "facts"}, timeout)["facts"])

    def stop(self, grace: float = 2.0) -> None:
        """Close its pipe (it exits; its workers stay, they end with the kernel), SIGKILL
        by pid if it has not after ``grace`` seconds; always reaped."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        with self._cond:
            idle = not self._children
        if idle and self.proc.poll() is None:  # it may be importing: it reads no pipe yet
            self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._err.close()


@dataclass
class WarmLauncher:
    """This process's warm launcher: the process's (``WARM``), kept across its groups until
    the process exits (``stop_launcher``) or a load-time variable changes (``warm_up``
    replaces it). A forked child has none (``forget``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)  # held to start or drop one
    launcher: Launcher | None = None  # the one it started last (None: none, or stopped)

    def forget(self) -> None:
        """In a forked child: the parent's launcher is not this process's."""
        self.launcher, self.lock = None, threading.Lock()


WARM = WarmLauncher()


def warm_up() -> Launcher:
    """This process's launcher, started now (without waiting for its imports) unless one
    runs under the same load-time environment."""
    with WARM.lock:
        old = WARM.launcher
        if old is not None and old.alive() and old.load_env == load_time_env(os.environ):
            return old
        launcher = WARM.launcher = Launcher()
    if old is not None:
        old.stop()
    return launcher


def current_launcher() -> Launcher | None:
    """This process's launcher, if it started one that still runs."""
    launcher = WARM.launcher
    return launcher if launcher is not None and launcher.alive() else None


def stop_unused_launcher() -> None:
    """Stop the launcher if it never started a worker (a start that failed its checks
    leaves nothing running)."""
    launcher = WARM.launcher
    if launcher is not None and launcher.forked == 0:
        stop_launcher()


def stop_launcher() -> None:
    """Stop this process's launcher (and the workers it forked, which leave with it)."""
    with WARM.lock:
        old, WARM.launcher = WARM.launcher, None
    if old is not None:
        old.stop()


atexit.register(stop_launcher)
os.register_at_fork(after_in_child=WARM.forget)


@dataclass
class LocalWorker:
    """A worker process this kernel started."""

    name: str
    rank: int
    proc: ForkedProcess
    log_path: Path
    left: bool = False  # it left on request; its exit is not a crash
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def how_died(self) -> str:
        if self.proc.lost:
            return "ended with its launcher"
        return how_died(self.proc.poll())

    def stopped(self) -> bool:
        """True while the process is stopped (SIGSTOP, a debugger): it answers nothing."""
        return is_stopped(self.pid)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        tail = text.rstrip("\n").splitlines()[-lines:]
        return "\n".join("    " + line for line in tail) or "    (log is empty)"

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; always reaps the process."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL always lands
            pass


def start_worker(name: str, rank: int, init_method: str, leader: str, group_dir: Path,
                 options: str, secret: str,
                 env: dict[str, str] | None = None) -> LocalWorker:
    """Start worker ``name``: ``rpcnb.worker.main()`` forked by this process's launcher,
    in a process group of its own, with ``env`` added to this process's environment;
    ``options``: its ``rpcnb.wire.options.GroupOptions`` as JSON (``to_json``)."""
    env = apply_quiet_env(dict(os.environ, **(env or {})))
    env["PYTHONUNBUFFERED"] = "1"
    log_path = group_dir / f"{name}.log"
    argv = [
        "--init-method", init_method,
        "--name", name,
        "--rank", str(rank),
        "--leader", leader,
        "--parent-pid", str(os.getpid()),
        "--options", options,
    ]
    # The secret goes through the launcher's pipe: not on a command line (ps) and not in
    # the environment (/proc/PID/environ keeps a process's first environment for good).
    launcher = warm_up()
    try:
        proc = launcher.fork(argv, secret, env, log_path, title=f"rpcnb {name}")
    except LauncherFailed:
        if not launcher.facts or launcher.alive():
            raise  # it never came up, or it hangs: say why
        # It had been ready and is gone now (killed by hand or by the OOM killer, between
        # two starts): one fresh launcher, once.
        proc = warm_up().fork(argv, secret, env, log_path, title=f"rpcnb {name}")
    return LocalWorker(name, rank, proc, log_path)


def wait_exit(workers: list[LocalWorker], timeout: float) -> None:
    """Wait until every one of ``workers`` has exited, ``timeout`` seconds at most in all."""
    deadline = Deadline.after(timeout)
    for w in workers:  # not waiting.until: it waits on each one's exit event, in turn
        try:
            w.proc.wait(deadline.left())
        except subprocess.TimeoutExpired:
            pass
