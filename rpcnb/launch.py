"""How worker processes come to exist: local subprocesses of this kernel.

Each worker is ``rpcnb.worker.main()`` in a fresh Python in its own session (so a kernel interrupt is
not also delivered to it), with stdout and stderr in a log file under the group's
directory. A worker watches its parent and exits when the kernel that started it dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` from /proc (R, S, T, Z, ...); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    return proc_state(pid) not in (None, "Z", "X")


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid``, including those in a session of their own (rpcnb's
    workers are): what to stop by pid when a kernel goes."""
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_all(pids: list[int]) -> None:
    """SIGKILL each pid that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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


@dataclass
class LocalWorker:
    """A worker process this kernel started."""

    name: str
    rank: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    left: bool = False  # it left on request; its exit is not a crash
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def how_died(self) -> str:
        return how_died(self.proc.poll())

    def stopped(self) -> bool:
        """True while the process is stopped (SIGSTOP, a debugger): it answers nothing."""
        return proc_state(self.pid) in ("T", "t")

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
                 options: dict[str, Any], secret: str,
                 env: dict[str, str] | None = None) -> LocalWorker:
    """Start worker ``name``: this Python, ``rpcnb.worker.main()``, in a session of its
    own, with ``env`` added to this process's environment."""
    env = apply_quiet_env(dict(os.environ, **(env or {})))
    env["PYTHONUNBUFFERED"] = "1"
    log_path = group_dir / f"{name}.log"
    cmd = [
        sys.executable, "-c", "from rpcnb.worker import main; main()",
        "--init-method", init_method,
        "--name", name,
        "--rank", str(rank),
        "--leader", leader,
        "--parent-pid", str(os.getpid()),
        "--options", json.dumps(options),
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, cwd=os.getcwd(),
        )
    # The secret goes through a pipe: not on the command line (ps) and not in the
    # environment (/proc/PID/environ keeps a process's first environment for good).
    assert proc.stdin is not None
    try:
        proc.stdin.write(secret.encode() + b"\n")
        proc.stdin.close()
    except OSError:
        pass  # it died at once; the caller sees it exit
    return LocalWorker(name, rank, proc, log_path)


def wait_exit(workers: list[LocalWorker], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for w in workers:
        try:
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
