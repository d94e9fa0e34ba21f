"""The warm launcher: a process that has imported torch and rpcnb's worker once, and forks
worker processes from that state on the kernel's request, so a worker is ready in a
fraction of a second instead of importing torch again.

It knows the program it forks by name only (as ``multiprocessing``'s forkserver knows its
preload modules): the kernel names the worker's module, whose ``main(argv, secret)`` a
forked child runs, so this layer imports nothing above it.

The kernel starts it (``rpcnb.procs.launch.Launcher``) as ``python -c "from
rpcnb.procs.forkserver import main; main('rpcnb.worker')"`` in a process group of its own, and
talks to it only through the two pipes on its stdin and stdout: nothing listens, and no
other process can ask it for anything. Requests and answers are JSON lines:

- ``{"op": "fork", "id": N, "argv": [...], "secret": ..., "env": {...}, "cwd": ...,
  "log": PATH, "title": ...}`` forks a worker; answer ``{"id": N, "pid": PID}``;
- ``{"op": "signal", "pid": PID, "sig": SIG}`` signals a worker it forked and has not
  reaped yet (so a pid the system gave to another process is never signalled);
- ``{"op": "facts", "id": N}``: whether CUDA is initialised here, its threads;
- unasked: ``{"ready": ...}`` once the imports are done, ``{"exit": PID, "code": C}``
  when a worker ended (``C`` as ``Popen.returncode``: negative for a signal).

Fork safety: it never initialises CUDA (a CUDA context does not survive a fork; it runs
with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` so that a ``torch.cuda.is_available()`` during an
import asks NVML instead of creating one), runs no tensor operation (torch's thread pools
start at the first one) and starts no Python thread. It exits when the kernel's pipe
closes or the kernel is gone; the workers it forked do not depend on it (they watch the
kernel, and end with it).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import select
import signal
import sys
import traceback
from typing import Any

from rpcnb import settings

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def preload(program: str) -> None:
    """Import what a worker needs before it can join a group (torch, its RPC, the worker's
    module ``program``, IPython's shell), without touching CUDA."""
    import IPython.core.interactiveshell  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.autograd  # noqa: F401
    import torch.distributed.nn  # noqa: F401
    import torch.distributed.rpc  # noqa: F401

    importlib.import_module(program)


def facts() -> dict[str, Any]:
    """What makes forking from here safe, as this process sees it."""
    import threading

    import torch

    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        tasks = []
    return {
        "pid": os.getpid(),
        "cuda_initialized": bool(torch.cuda.is_initialized()),
        "python_threads": threading.active_count(),
        "os_threads": len(tasks),
        "torch": torch.__version__,
    }


def _send(msg: dict[str, Any]) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def _set_title(title: str) -> None:
    """The name ``ps -o comm``/``top`` show (15 bytes), so forked workers are told apart."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, title.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _become_worker(program: str, req: dict[str, Any], wake: tuple[int, int]) -> None:
    """In the forked child: a worker's process, as if ``rpcnb.procs.launch`` had exec'd it."""
    code = 1
    try:
        # A process group of its own: a kernel interrupt (SIGINT to the kernel's group)
        # does not reach it. Not a session of its own: Linux's scheduler gives each session
        # an equal share of the CPU (autogroup), and a worker in one of its own is
        # scheduled as a separate program from the kernel and its peers, which made a
        # CPU-bound RPC program 1.15-1.2x slower than the same processes in one session on
        # two cores (docs/benchmarks.md). mp.spawn and torchrun keep their workers in the
        # caller's session too.
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        for fd in wake:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the pipes to the kernel are the launcher's, not the worker's
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        for name in ("stdout", "stderr"):  # unbuffered, as PYTHONUNBUFFERED makes them
            stream = io.TextIOWrapper(open(1 if name == "stdout" else 2, "wb", buffering=0,  # noqa: SIM115
                                           closefd=False), write_through=True)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = ["-c", *req["argv"]]
        _set_title(req.get("title", "rpcnb-worker"))
        numpy = sys.modules.get("numpy")
        if numpy is not None:  # every worker its own random state, as a fresh process has
            numpy.random.seed()
        importlib.import_module(program).main(list(req["argv"]), secret=req["secret"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def serve(program: str, kernel_pid: int) -> None:
    """Answer the kernel's requests until its pipe closes or it is gone."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    pending = b""
    _send({"ready": True, **facts()})
    while True:
        ready, _, _ = select.select([0, wake_r], [], [], 1.0)
        if os.getppid() != kernel_pid:  # the kernel died; a fork of it may hold our pipe
            return
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        while children:  # reap every worker that ended, and say how
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _send({"exit": pid, "code": _exit_code(status)})
        if 0 not in ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return  # the kernel closed its pipe
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            req = json.loads(line)
            op = req.get("op")
            if op == "fork":
                pid = os.fork()
                if pid == 0:
                    _become_worker(program, req, (wake_r, wake_w))
                children.add(pid)
                _send({"id": req["id"], "pid": pid})
            elif op == "signal":
                if req["pid"] in children:
                    try:
                        os.kill(req["pid"], req["sig"])
                    except ProcessLookupError:
                        pass
            elif op == "facts":
                _send({"id": req["id"], "facts": facts()})


def _leave_terminal() -> None:
    """Give up the controlling terminal a plain-Python driver (or terminal IPython) has,
    for this process and the workers it forks: they stay in its session (one program to
    the scheduler) but in process groups of their own, in the background, where a read of
    ``/dev/tty`` (``getpass``, an ssh or sudo prompt in a worker's cell) would stop the
    worker for good. Without a terminal such a read fails at once, as in a session of its
    own. A Jupyter kernel has none: nothing to do."""
    if os.getsid(0) == os.getpid():
        return  # a session leader would hang up its whole session's terminal: never here
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return  # no controlling terminal
    try:
        import fcntl
        import termios

        fcntl.ioctl(fd, termios.TIOCNOTTY)
    except OSError:
        pass
    finally:
        os.close(fd)


def main(program: str) -> None:
    """Preload ``program`` (a module with ``main(argv, secret)``), then fork it on request."""
    kernel_pid = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _leave_terminal()
    settings.set_default(NVML_CHECK, "1")
    preload(program)
    try:
        serve(program, kernel_pid)
    finally:
        os._exit(0)  # its workers stay: they end with the kernel, not with their launcher
