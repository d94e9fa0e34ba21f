"""Fixtures that start real things: IPython kernels (jupyter_client) and, through them,
real rpcnb worker processes. Every process a test starts is stopped by pid at the end,
also when the test fails."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
from jupyter_client import KernelManager
from pids import Seen

from rpcnb.procs.processes import descendants, kill_all, pid_alive

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench package's helpers
from bench.netsetup import veth_pair  # noqa: E402

# The same helpers rpcnb's tools use to find and stop what a kernel started.
children_of = descendants


def said(out: Output) -> str:
    """What a cell that did not print what was asked said instead, in short."""
    text = (f"{out.error['ename']}: {out.error['evalue']}" if out.error
            else (out.stdout + out.stderr).strip())
    return repr(text[-300:])


def started_here() -> list[int]:
    """The processes that an rpcnb group of this test process (``rpcnb.init`` here)
    started: its warm launcher, or its worker processes, with their descendants. Not every
    descendant of this process: the shared kernel of ``group``, a JupyterLab server and
    their own workers are children of it too (a test that killed them all took the next
    module's shared kernel with it)."""
    import psutil

    found = []
    for child in psutil.Process().children():
        try:
            line = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "rpcnb.procs.forkserver" in line or "rpcnb.worker" in line:
            found += [child.pid, *descendants(child.pid)]
    return found


@dataclass
class Output:
    """What one executed cell showed, in order, with arrival times."""

    stdout: str = ""
    stderr: str = ""
    results: list[dict[str, Any]] = field(default_factory=list)  # execute_result data
    displays: list[dict[str, Any]] = field(default_factory=list)  # display_data messages
    comms: list[dict[str, Any]] = field(default_factory=list)  # comm_open/msg/close messages
    messages: int = 0  # iopub messages of the cell, status ones aside
    error: dict[str, Any] | None = None
    events: list[tuple[float, str, Any]] = field(default_factory=list)
    started: float = 0.0
    finished: float = 0.0
    msg_id: str = ""
    prompts: list[tuple[str, bool]] = field(default_factory=list)  # input requests: (prompt, password)
    # (kind, text, the kernel's time of sending) of streams and input requests: their order
    # as the kernel sent them (the two come on different channels)
    sent: list[tuple[str, str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(r.get("text/plain", "") for r in self.results)

    @property
    def traceback(self) -> str:
        # IPython prints a UsageError to stderr instead of sending an error message
        text = "\n".join(self.error["traceback"]) if self.error else self.stderr
        return re.sub(r"\x1b\[[0-9;]*m", "", text)


# How often a running cell's kernel is searched for the processes it started (each
# search reads every process of the machine: 5-10 ms, which every 0.1 s and in three
# parallel test processes took a tenth of the machine); and once more when the cell ends,
# so the next cell need not search again as it starts (a test's many short cells did).
SCAN_EVERY = 0.5


class Kernel:
    """A real IPython kernel, driven as a notebook front end would drive it."""

    def __init__(self, kernel_name: str = "python3", env: dict[str, str] | None = None) -> None:
        env = dict(os.environ, **(env or {}))
        env.pop("TORCH_CPP_LOG_LEVEL", None)  # rpcnb must set it itself
        for tries_left in (2, 1, 0):
            self.km = KernelManager(kernel_name=kernel_name)
            self.km.start_kernel(env=env, cwd=str(Path(__file__).parent))
            self.kc = self.km.blocking_client()
            self.kc.start_channels()
            try:
                self.kc.wait_for_ready(timeout=60)
                break
            except RuntimeError as exc:
                # jupyter_client picks the kernel's five ports free, then the kernel binds
                # them: with tests starting kernels in parallel, another process can take
                # one in between (the kernel dies: "Address already in use"). New ports.
                if "died" not in str(exc) or not tries_left:
                    raise
                self.kc.stop_channels()
                with contextlib.suppress(Exception):
                    self.km.shutdown_kernel(now=True)
        self.pid = self.km.provisioner.pid  # type: ignore[union-attr]
        self.known = Seen([self.pid])
        self.scanned = 0.0  # when its processes were last searched for (time.monotonic)
        self.stray: list[dict[str, Any]] = []  # iopub messages of earlier cells, kept
        self.init_output: Output | None = None  # a shared group's %rpc_init cell

    def later(self, msg_id: str, until: Any = None, timeout: float = 30) -> list[dict[str, Any]]:
        """Messages of the cell ``msg_id`` that came after it finished (a background cell
        prints into the cell that started it), reading until ``until(messages)`` or
        ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            mine = [m for m in self.stray if m["parent_header"].get("msg_id") == msg_id]
            if until is None or until(mine) or time.monotonic() > deadline:
                return mine
            try:
                self.stray.append(self.kc.get_iopub_msg(timeout=0.1))
            except Empty:
                pass

    def execute(self, code: str, timeout: float = 120, allow_error: bool = False,
                interrupt_after: float | None = None, answers: Any = None,
                allow_stdin: bool = True) -> Output:
        """Run ``code`` as a notebook cell. An input request (``input()``, pdb) is answered
        as a person would: with the next of ``answers`` (a list), or ``answers(prompt)``
        (a callable; None: interrupt the kernel instead); with none, the kernel is
        interrupted (``allow_stdin=False``: a front end without stdin, as nbclient's)."""
        out = Output(started=time.monotonic())
        msg_id = out.msg_id = self.kc.execute(code, allow_stdin=allow_stdin)
        queue_ = list(answers) if isinstance(answers, (list, tuple)) else None
        deadline = time.monotonic() + timeout
        interrupted = False
        while True:
            if time.monotonic() - self.scanned > SCAN_EVERY:
                self.scan()
            if interrupt_after is not None and not interrupted and \
                    time.monotonic() - out.started > interrupt_after:
                self.km.interrupt_kernel()
                interrupted = True
                out.events.append((time.monotonic(), "interrupt", None))
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell did not finish in {timeout} s: {code[:80]!r}\n{out}")
            if allow_stdin and self.kc.stdin_channel.msg_ready():
                req = self.kc.get_stdin_msg(timeout=1)
                prompt = req["content"]["prompt"]
                out.prompts.append((prompt, bool(req["content"].get("password"))))
                out.events.append((time.monotonic(), "input_request", prompt))
                out.sent.append(("input_request", prompt, req["header"]["date"]))
                reply = (queue_.pop(0) if queue_ else None) if queue_ is not None else \
                    (answers(prompt) if answers is not None else None)
                if reply is None:
                    self.km.interrupt_kernel()
                    out.events.append((time.monotonic(), "interrupt", None))
                else:
                    self.kc.input(reply)
            try:
                msg = self.kc.get_iopub_msg(timeout=0.05 if allow_stdin else 0.1)
            except Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                if msg["msg_type"] != "status":
                    self.stray.append(msg)
                continue
            kind, content = msg["msg_type"], msg["content"]
            now = time.monotonic()
            if kind != "status":
                out.messages += 1
            if kind == "stream":
                setattr(out, content["name"], getattr(out, content["name"]) + content["text"])
                out.sent.append((content["name"], content["text"], msg["header"]["date"]))
                out.events.append((now, content["name"], content["text"]))
            elif kind == "execute_result":
                out.results.append(content["data"])
                out.events.append((now, kind, content["data"]))
            elif kind in ("display_data", "update_display_data"):
                out.displays.append(content)
                out.events.append((now, kind, content))
            elif kind in ("comm_open", "comm_msg", "comm_close"):
                out.comms.append(msg)
                out.events.append((now, kind, content))
            elif kind == "error":
                out.error = content
                out.events.append((now, kind, content))
            elif kind == "status" and content["execution_state"] == "idle":
                out.finished = now
                break
        self.scan()
        if (out.error or "UsageError" in out.stderr) and not allow_error:
            raise AssertionError("cell failed:\n" + out.traceback)
        return out

    def scan(self) -> None:
        """Note the processes the kernel runs now, to stop them by pid at the end."""
        self.known.update(children_of(self.pid))
        self.scanned = time.monotonic()

    def value(self, expr: str) -> Any:
        """Evaluate ``expr`` in the kernel and return it (via repr + literal_eval)."""
        import ast

        out = self.execute(f"print(repr({expr}))")
        return ast.literal_eval(out.stdout.strip())

    def close(self) -> None:
        self.known.update(children_of(self.pid))
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=True)
        except Exception:
            pass
        kill_all(self.known.alive())


def wait_until(cond: Any, timeout: float = 5.0, poll: float = 0.05) -> bool:
    """Whether ``cond()`` became true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll)
    return bool(cond())


def run_watched(cmd: list[str], timeout: float, poll: float = 0.1,
                **popen: Any) -> tuple[int | None, Any, Any, Seen]:
    """Run ``cmd`` to its end (``timeout`` seconds at most), noting every process it
    starts; all of them are stopped by pid afterwards, also on failure. Returns the exit
    code, stdout, stderr and the pids seen (its own included)."""
    proc = subprocess.Popen(cmd, **popen)
    seen = Seen([proc.pid])
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(children_of(proc.pid))
            time.sleep(poll)
        out, err = proc.communicate(timeout=10)
    finally:
        seen.update(children_of(proc.pid))
        seen.kill()
    return proc.returncode, out, err, seen


@pytest.fixture
def kernel_factory():
    started: list[Kernel] = []

    def make(kernel_name: str = "python3", env: dict[str, str] | None = None) -> Kernel:
        k = Kernel(kernel_name, env)
        started.append(k)
        return k

    yield make
    for k in started:
        k.close()
    seen = Seen()
    for k in started:
        seen.merge(k.known)
    alive = stopped(seen)
    assert not alive, f"processes left running: {alive}"


@pytest.fixture
def kernel(kernel_factory) -> Kernel:
    return kernel_factory()


def stopped(pids: Iterable[int] | Seen, timeout: float = 5.0) -> list[int]:
    """The pids of ``pids`` still alive ``timeout`` seconds after they were killed (SIGKILL
    is delivered asynchronously): what a fixture's teardown asserts empty. Of a ``Seen``,
    only the processes seen count, not later ones with the same pid."""
    def alive() -> list[int]:
        return pids.alive() if isinstance(pids, Seen) else sorted(p for p in pids if pid_alive(p))

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        time.sleep(0.05)
    return alive()


# What a shared group's kernel runs between two tests: background cells ended, every
# worker's namespace and then the kernel's emptied (IPython's %reset -f, which keeps the
# magics and rpcnb's own state). It prints True when all of that worked.
RESET = """\
import rpcnb as _rpcnb_reset
_jobs = _rpcnb_reset.jobs(include_ended=False)
for _job in _jobs:
    _job.cancel()
_ok = all(_job.wait(15) for _job in _jobs)
_rpcnb_reset.run(_rpcnb_reset.ALL, "get_ipython().run_line_magic('reset', '-f')", fetch=True)
print(_ok)
"""
HEALTH = ("%remote --all --fetch __import__('os').getpid()")
# What a shared group's kernel runs when the next module takes it: its members forget the
# calls they timed (as in a group of their own), the workers first, then the kernel, whose
# call to them is timed too. It binds no name, and prints True when that worked.
HANDOVER = """\
__import__('rpcnb').run(__import__('rpcnb').ALL, "__import__('rpcnb.telemetry').telemetry.clear()",
                        fetch=True)
__import__('rpcnb.telemetry').telemetry.clear()
print(True)
"""
# What the kernel runs to leave the group it is in, if any (%rpc_shutdown), and forget what
# it timed and the device map %rpc_devmap's "apply" kept for the next %rpc_init; it binds
# no name and prints True when that worked.
LEAVE = """\
if __import__('rpcnb.session.state').session.state.active() is not None:
    __import__('rpcnb').shutdown()
__import__('rpcnb.telemetry').telemetry.clear()
__import__('rpcnb.wire.options').wire.options.keep_device_map(None)
print(True)
"""
# The kernel's environment and working directory, as the test got the kernel (a test may
# change both; the next test gets them as they were).
WHERE = "(dict(__import__('os').environ), __import__('os').getcwd())"
RESTORE = """\
__import__('os').environ.clear()
__import__('os').environ.update({env!r})
__import__('os').chdir({cwd!r})
print(True)
"""
GRACE = 5.0  # seconds a group's processes get to end after it was shut down


def is_launcher(pid: int, kernel_pid: int) -> bool:
    """Whether ``pid`` is the kernel's warm launcher (rpcnb.procs.forkserver), which lives
    as long as the kernel: the workers it forked are its children, not the kernel's."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.ppid() == kernel_pid and "rpcnb.procs.forkserver" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


@dataclass
class Lent:
    """The shared kernel as a test borrowed it: its environment and working directory,
    the processes it ran then, and every pid it had been seen to start."""

    env: dict[str, str]
    cwd: str
    running: Seen
    known: Seen


class SharedGroup:
    """The kernel of this test process that tests share (``GroupPool``), with rpcnb
    loaded. For the ``group`` fixture it is worker0 of a group of worker1 and worker2
    (``%rpc_init --workers 2``, or the module's ``GROUP_INIT`` line: ``init``); a test
    that starts, kills, restarts or shuts down members borrows it in no group
    (``lend``/``give_back``: the ``rpcnb_kernel`` and ``own_group`` fixtures), and the next
    ``group`` test starts the group again on the same kernel: a warm re-init from the
    kernel's launcher, a third of a second instead of the 5 s of CPU that a kernel and its
    launcher cost to start (both import torch).

    Before each ``group`` test it is checked: the kernel and both workers alive, the same
    pids as when the group started, and every worker answering a cell; after each test that
    passed, its background cells are ended and the workers' and the kernel's namespaces
    emptied. When any of that fails, or the test failed (a cell may be left running), the
    kernel is stopped and the next test gets a new one. A test that borrowed it gives it
    back with its group shut down, every process that group started ended (else killed and
    the test fails), the environment and working directory as they were, and the namespace
    emptied. Its processes are stopped by pid when the test process ends, and the teardown
    fails if one is left."""

    def __init__(self, init: str = "%rpc_init --workers 2") -> None:
        self.init = init
        self.kernel: Kernel | None = None
        self.running: str | None = None  # the %rpc_init line of the group it runs now
        self.pids: dict[str, int] = {}
        self.known = Seen()
        self.starts = 0  # kernels started
        self.lent: Lent | None = None
        self.test = ""  # the test that has it now
        self.stops: list[str] = []  # why it was stopped before the end: "test: why"

    def _start(self) -> Kernel:
        k = Kernel()
        self.kernel = k
        self.starts += 1
        k.execute("%load_ext rpcnb")
        return k

    def _leave(self) -> str:
        """The kernel in no group: the one it runs shut down, its workers ended. Returns
        "" when it is so, else why not."""
        k = self.kernel
        assert k is not None
        workers = Seen(p for p in self.pids.values() if p != k.pid)
        self.running, self.pids = None, {}
        if not k.km.is_alive():
            proc = getattr(k.km.provisioner, "process", None)
            return f"its kernel died (exit status {proc.poll() if proc else '?'})"
        try:
            done = k.execute(LEAVE, timeout=30, allow_error=True)
        except (TimeoutError, OSError) as exc:
            return f"leaving its group: {exc!r}"
        if done.stdout.strip() != "True":
            return f"leaving its group: {said(done)}"
        left = stopped(workers, GRACE)
        return f"its workers {left} were alive {GRACE:.0f} s after it left" if left else ""

    def healthy(self) -> bool:
        k = self.kernel
        if k is None or not k.km.is_alive():
            return False
        if not all(pid_alive(p) for p in self.pids.values()):
            return False
        try:
            out = k.execute(HEALTH, timeout=15, allow_error=True)
            return out.error is None and not out.stderr and out.text == repr(
                {n: p for n, p in self.pids.items() if n != "worker0"})
        except (TimeoutError, OSError):
            return False

    def get(self) -> Kernel:
        """The group, healthy: the one kept, or one started again (on the same kernel
        when it is alive and leaves the group it was in, else on a new one)."""
        if self.kernel is not None and self.running == self.init and not self.healthy():
            self.stop("its group was not healthy")
        if self.kernel is not None and self.running != self.init and (why := self._leave()):
            self.stop(f"for another %rpc_init line: {why}")
        k = self.kernel or self._start()
        if self.running != self.init:
            k.init_output = k.execute(self.init)
            self.running = self.init
            self.pids = worker_pids(k)
        k.stray.clear()
        return k

    def hand_on(self) -> None:
        """To the next module: what its members timed is forgotten; a group that cannot
        do that is stopped."""
        k = self.kernel
        if k is None or self.running is None:
            return
        try:
            if k.execute(HANDOVER, timeout=30, allow_error=True).stdout.strip() == "True":
                return
        except (TimeoutError, OSError):
            pass
        self.stop("it could not be handed to the next module")

    def reset(self) -> None:
        """Between two tests; a group that cannot be reset is stopped."""
        k = self.kernel
        if k is None:
            return
        if not k.km.is_alive() or not all(pid_alive(p) for p in self.pids.values()):
            self.stop("a member of its group died in the test")
            return
        try:
            ok = k.execute(RESET, timeout=30, allow_error=True)
            k.execute("%reset -f", timeout=15)
            if ok.error is not None or ok.stdout.strip() != "True":
                self.stop(f"its group could not be reset after the test: {said(ok)}")
        except (TimeoutError, AssertionError, OSError) as exc:
            self.stop(f"its group could not be reset after the test: {str(exc)[:300]!r}")

    def lend(self) -> Kernel:
        """The kernel with rpcnb loaded, in no group, its namespace empty: for a test that
        starts (and may kill, restart or shut down) a group of its own."""
        if self.kernel is not None and (why := self._leave()):
            self.stop(f"to be lent: {why}")
        k = self.kernel or self._start()
        env, cwd = k.value(WHERE)
        k.scan()
        self.lent = Lent(env, cwd, Seen(children_of(k.pid)), k.known.copy())
        k.stray.clear()
        k.init_output = None
        return k

    def give_back(self, failed: bool) -> list[int]:
        """After a test that borrowed the kernel: the processes its group left, killed
        (the test fails on them); a kernel that failed a test, or cannot be put back as
        it was lent, is stopped."""
        k, lent, self.lent = self.kernel, self.lent, None
        if k is None or lent is None:
            return []
        if failed or not k.km.is_alive():
            self.stop("the test failed" if failed else "its kernel died in the test")
            return []
        why = self._leave()
        try:
            if not why:
                done = k.execute(RESTORE.format(env=lent.env, cwd=lent.cwd), timeout=15,
                                 allow_error=True)
                if done.stdout.strip() != "True":
                    why = f"restoring its environment: {said(done)}"
                else:
                    k.execute("%reset -f", timeout=15)
        except (TimeoutError, AssertionError, OSError) as exc:
            why = f"putting it back: {str(exc)[:300]!r}"
        k.scan()
        # what the test's groups started (seen since the lend: not a pid of before, which
        # another process may have by now)
        started = k.known.since(lent.known).since(lent.running).only(
            lambda p: p != k.pid and not is_launcher(p, k.pid))
        left = stopped(started, GRACE)
        if left:
            kill_all(left)
            why = why or f"the test's processes {left} were left"
        if why:
            self.stop(f"to be given back: {why}")
        return left

    def stop(self, why: str = "") -> None:
        """Stop the kernel; ``why``, when before the end, is kept (``GroupPool.record``)."""
        k, self.kernel = self.kernel, None
        self.running, self.pids = None, {}
        if k is None:
            return
        if why:
            self.stops.append(f"{self.test}: {why}")
        k.close()
        self.known.merge(k.known)

    def close(self) -> list[int]:
        """Stop it; the pids of its processes (of every group it made) still alive."""
        self.stop()
        return stopped(self.known)


class GroupPool:
    """The shared kernel of this test process (``SharedGroup``), passed from module to
    module: a module's ``shared_group`` takes it with the module's %rpc_init line (the
    module before left it reset and healthy, or stopped); with another line than the
    group it runs, the next ``group`` test leaves that group and starts one with the new
    line on the same kernel. Starting a kernel and its group costs about 5 s of CPU
    (torch imported by the kernel and by its launcher), which a suite that keeps both
    cores busy pays in wall time; a warm re-init costs a tenth of that."""

    def __init__(self) -> None:
        self.current = SharedGroup()
        self.left = Seen()  # processes of the groups stopped that outlived the stop

    def take(self, init: str) -> SharedGroup:
        self.current.hand_on()
        self.current.init = init
        return self.current

    def close(self) -> list[int]:
        """Stop the kernel; the pids of every group's processes still alive."""
        self.left |= self.current.close()
        return self.left.alive()

    def record(self) -> None:
        """How many kernels this test process started, and why each was stopped before
        the end: ``shared-kernel-<worker>-<pid>.txt`` in ``$TEST_SUITE_RESULTS`` (where
        scripts/test_suite.py, which sets it, reads and sums them)."""
        where = os.environ.get("TEST_SUITE_RESULTS")
        if not where or not Path(where).is_dir():
            return
        name = f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}"
        lines = [f"starts {self.current.starts}", *self.current.stops]
        Path(where, f"shared-kernel-{name}.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="session")
def group_pool():
    pool = GroupPool()
    yield pool
    left = pool.close()
    pool.record()
    assert not left, f"processes of the shared groups left running: {left}"


@pytest.fixture(scope="module")
def shared_group(request: pytest.FixtureRequest, group_pool: GroupPool):
    yield group_pool.take(getattr(request.module, "GROUP_INIT", "%rpc_init --workers 2"))


@pytest.fixture
def group(shared_group: SharedGroup, request: pytest.FixtureRequest) -> Any:
    """A kernel that is worker0 of a group with worker1 and worker2, shared by the tests
    of this module and of the modules after it (``SharedGroup``, ``GroupPool``): a test
    that kills, restarts, adds or shuts down members, or changes the kernel's settings,
    takes ``own_group`` instead."""
    shared_group.test = request.node.nodeid
    yield shared_group.get()
    report = getattr(request.node, "rpcnb_call_report", None)
    if report is None or report.failed:
        shared_group.stop("the test failed")
    else:
        shared_group.reset()


@pytest.fixture
def rpcnb_kernel(group_pool: GroupPool, request: pytest.FixtureRequest) -> Any:
    """The test process's shared kernel (``SharedGroup``), with rpcnb loaded and in no
    group: for a test that starts groups with flags of its own, and may kill, freeze,
    restart, add, join or shut down their members, or change the kernel's environment or
    working directory (both are put back). It gets the kernel back with every group shut
    down and every process they started ended (those left are killed and fail the test).
    A test that ends or restarts the kernel itself, or needs one that never ran rpcnb
    (``%load_ext``, the launcher's start), takes ``kernel``."""
    group_pool.current.test = request.node.nodeid
    k = group_pool.current.lend()
    yield k
    report = getattr(request.node, "rpcnb_call_report", None)
    left = group_pool.current.give_back(report is None or report.failed)
    assert not left, f"processes the test's group started were left running: {left}"


@pytest.fixture
def own_group(rpcnb_kernel: Kernel) -> Kernel:
    """The shared kernel (``rpcnb_kernel``) as worker0 of a group of its own with worker1
    and worker2: for a test that kills, freezes, restarts, adds, joins or shuts down
    members, or changes the kernel's settings."""
    rpcnb_kernel.execute("%rpc_init --workers 2")
    return rpcnb_kernel


@pytest.fixture
def own_kernel_group(kernel: Kernel) -> Kernel:
    """A new kernel that is worker0 of a group with worker1 and worker2: for a test that
    kills or restarts the kernel itself."""
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 2")
    return kernel


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    if report.when == "call":
        item.rpcnb_call_report = report  # type: ignore[attr-defined]
    return report


def worker_pids(k: Kernel) -> dict[str, int]:
    return k.value("{m.name: m.pid for m in __import__('rpcnb').group().members}")


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it has stopped. The signal is only
    queued when ``os.kill`` returns: on a busy machine a thread of the process can still
    answer a request for some milliseconds, so a test that asks right away may be told
    the frozen member is fine."""
    os.kill(pid, signal.SIGSTOP)
    tasks = Path(f"/proc/{pid}/task")

    def all_stopped() -> bool:
        states = []
        for task in tasks.iterdir():
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue  # a thread that ended meanwhile
            states.append(stat[stat.rindex(")") + 2])
        return bool(states) and all(st in "tT" for st in states)

    if not wait_until(all_stopped, timeout=timeout, poll=0.01):
        os.kill(pid, signal.SIGCONT)
        raise AssertionError(f"pid {pid} did not stop within {timeout} s of SIGSTOP")


PYTHON = sys.executable


def listening_addresses(pid: int) -> list[str]:
    """The addresses ``pid`` listens on (TCP, v4 and v6), read from /proc."""
    import ipaddress

    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hexaddr, port = local.split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc stores each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addr = ipaddress.ip_address(raw)
            found.append(f"{addr}:{int(port, 16)}")
    return found


@pytest.fixture(scope="module")
def rpcnb_pickler() -> Any:
    """rpcnb's pickler in torch for a module's tests (``serialize.install``), and torch's own
    again after them (``serialize.uninstall``), unless it was installed before: by a group
    this process is in, say."""
    from rpcnb.paths import serialize
    from rpcnb.session import state

    before = serialize.is_installed()
    serialize.install()
    yield
    if not before and not state.is_initialized():
        serialize.uninstall()


@pytest.fixture
def tangled(tmp_path: Path) -> Path:
    """A copy of the package where a low layer imports the API inside a function (for the
    checks of the layers: tests/unit/test_layers.py, tests/build/test_import_contract.py)."""
    package = Path(__file__).resolve().parents[1] / "rpcnb"
    shutil.copytree(package, tmp_path / "rpcnb", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(package.parent / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "rpcnb" / "session" / "state.py", "a") as f:
        f.write("\n\ndef _upward():\n    from rpcnb import api\n\n    return api\n")
    return tmp_path


@pytest.fixture
def test_address():
    """A veth interface of our own with a private test address (needs root, iproute2)."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("creating a test interface needs root and iproute2")
    tag = os.getpid() % 10000  # parallel test processes each make their own
    name, peer, addr = f"rpcnbt{tag}a", f"rpcnbt{tag}b", f"10.215.{tag % 250}.1"
    made = subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name",
                           peer], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a dummy interface here: {made.stderr.decode().strip()}")
    try:
        subprocess.run(["ip", "addr", "add", f"{addr}/32", "dev", name], check=True)
        subprocess.run(["ip", "link", "set", name, "up"], check=True)
        subprocess.run(["ip", "link", "set", peer, "up"], check=True)
        yield name, addr
    finally:
        subprocess.run(["ip", "link", "del", name], capture_output=True)


class ApiGroup:
    """This test process as worker0 of a group of real workers (the Python API; one, or the
    module's ``API_WORKERS``, started with the module's ``API_INIT`` arguments), kept for
    the tests of one module: checked before each test
    (every worker alive and answering), started again when not, or when the test before
    failed."""

    def __init__(self, workers: int = 1, **init: Any) -> None:
        self.workers = workers
        self.init = init  # more of rpcnb.init's arguments: the module's API_INIT
        self.seen = Seen()
        self.up = False

    def healthy(self) -> bool:
        import torch.distributed.rpc as rpc

        import rpcnb
        from rpcnb.session import state

        if not (self.up and state.is_initialized()):
            return False
        try:
            members = {m.name: m for m in rpcnb.group().members}
            names = [f"worker{i}" for i in range(1, self.workers + 1)]
            return all(n in members and pid_alive(members[n].pid) and
                       rpc.rpc_sync(n, os.getpid, timeout=10) == members[n].pid for n in names)
        except Exception:
            return False

    def get(self) -> None:
        import rpcnb

        if self.up and not self.healthy():
            self.stop()
        if not self.up:
            rpcnb.init(self.workers, **self.init)
            self.up = True
            self.seen.update(started_here())

    def reset(self) -> None:
        """Between two tests: every worker's namespace emptied (what tests keep there holds
        this process's buffers and tensors); a group that cannot be reset is stopped."""
        import rpcnb

        try:
            rpcnb.run(rpcnb.ALL, "get_ipython().run_line_magic('reset', '-f')", fetch=True,
                      timeout=15)
        except Exception:
            self.stop()

    def stop(self) -> None:
        import rpcnb
        from rpcnb.session import state

        self.seen.update(started_here())
        if state.is_initialized():
            rpcnb.shutdown()
        self.up = False
        self.seen.kill()


@pytest.fixture(scope="module")
def shared_api_group(request: pytest.FixtureRequest):
    holder = ApiGroup(getattr(request.module, "API_WORKERS", 1),
                      **getattr(request.module, "API_INIT", {}))
    yield holder
    holder.stop()
    left = stopped(holder.seen)
    assert not left, f"processes left running: {left}"


@pytest.fixture
def no_api_group(shared_api_group: ApiGroup) -> None:
    """This test process in no group: the module's shared ``api_group`` is stopped first
    (for a test that starts a group of its own in this process, or checks what happens
    outside one)."""
    shared_api_group.stop()


@pytest.fixture
def own_api_group(shared_api_group: ApiGroup) -> Any:
    """A group of this test's own, as ``api_group`` makes it (the module's shared one is
    stopped first): for a test that needs fresh pools or counts, or shuts the group down.
    Its processes are stopped by pid at the end."""
    shared_api_group.stop()
    own = ApiGroup(shared_api_group.workers, **shared_api_group.init)
    own.get()
    yield
    own.stop()
    left = stopped(own.seen)
    assert not left, f"processes left running: {left}"


@pytest.fixture
def api_group(shared_api_group: ApiGroup, request: pytest.FixtureRequest) -> Any:
    """This test process as worker0 of a group (the Python API) with a real worker1 (and
    more: the module's ``API_WORKERS``), shared by the tests of the module (``ApiGroup``);
    every process it started is stopped by pid when the module ends."""
    shared_api_group.get()
    yield
    report = getattr(request.node, "rpcnb_call_report", None)
    if report is None or report.failed:
        shared_api_group.stop()
    elif shared_api_group.up:
        shared_api_group.reset()


# Network namespaces: a second "host" on this machine (tests/kernel/test_channel_model.py,
# tests/net/test_two_hosts.py)


def netns_blocker() -> str | None:
    """Why this test cannot make network namespaces here (None when it can)."""
    if os.geteuid() != 0:
        return f"creating network namespaces needs root; this test runs as uid {os.geteuid()}"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"rpcnb-check-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"this machine does not let the test create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def private_shm_blocker() -> str | None:
    """Why a worker cannot get a private, small /dev/shm here (None when it can)."""
    if os.geteuid() != 0:
        return f"mounting a private /dev/shm needs root; this test runs as uid {os.geteuid()}"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=32m tmpfs /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"this machine does not let the test mount a private /dev/shm: {probe.stderr.strip()}"
    return None


def small_shm_worker(connection: str, name: str, log: Path) -> subprocess.Popen:
    """A headless worker that joins with ``connection`` as ``name`` from a private mount
    namespace with a 32 MB /dev/shm, and looks like it runs in a container (podman's
    ``container`` variable): what %rpc_doctor must report. The caller stops it by pid."""
    env = dict(os.environ, container="podman", PYTHONPATH=str(Path(__file__).parents[1]))
    script = ("mount -t tmpfs -o size=32m tmpfs /dev/shm && exec \"$0\" -m rpcnb.worker "
              f"--join {connection} --name {name} --no-shm")
    with open(log, "wb") as f:
        return subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                 script, sys.executable], stdout=f, stderr=subprocess.STDOUT,
                                env=env)


@pytest.fixture
def netns():
    """A network namespace joined to this one by a veth pair on a private /30."""
    why = netns_blocker()
    if why:
        pytest.skip(why)
    tag = os.getpid() % 100000
    with veth_pair(f"rpcnb-t{tag}", f"rpv{tag}", f"10.213.{tag % 250}") as net:
        yield net


# -- the channel driver (tests/kernel/test_channel_model.py, tests/gpu/test_gpu_channels.py)

DRIVER = str(Path(__file__).parent / "channel_driver.py")
PAIRS = {f"{a}->{b}" for a in ("worker0", "worker1", "worker2")
         for b in ("worker0", "worker1", "worker2") if a != b}


def run_driver(args: list[str], out: Path, timeout: float = 180) -> dict:
    proc = subprocess.Popen([sys.executable, DRIVER, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    seen = Seen()
    try:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            seen.update(children_of(proc.pid))
            raise
        assert proc.returncode == 0, output.decode(errors="replace")[-3000:]
        return json.loads(out.read_text())
    finally:
        seen.update(children_of(proc.pid))
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        seen.kill()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Under ``--dist loadgroup``, pytest-xdist names each test's group in its node id
    (``...@net``); where it cannot (pytest 9.2 with xdist 3.8: pytest-dev/pytest-xdist#1386)
    every group would be ignored, and the shared kernels started once per test: stop."""
    if node.config.getoption("dist", None) != "loadgroup":
        return
    lost = [i for i in ids if i.startswith(("tests/net/", "tests/browser/test_lab")) and
            "@" not in i]
    if lost:
        pytest.exit(f"pytest-xdist ignored the xdist_group of {lost[0]} and others: this "
                    "pytest's node ids do not take group names (pytest-dev/pytest-xdist#1386); "
                    "install the pytest of pyproject.toml's test extra (pip install -e "
                    "'.[test]')", returncode=4)


# tests/unit starts no process: an audit hook (they cannot be removed, so one for the run)
# notes each process started while a unit test runs, and the test fails on it.
PROCESS_EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
                  "os.exec", "os.system"}


@dataclass
class ProcessWatch:
    """What the audit hook saw while ``on``: the events that start a process."""

    on: bool = False
    seen: list[str] = field(default_factory=list)

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if self.on and event in PROCESS_EVENTS:
            self.seen.append(f"{event}{args[:2]!r}")


PROCESS_WATCH = ProcessWatch()
sys.addaudithook(PROCESS_WATCH)


@pytest.fixture(autouse=True)
def unit_tests_start_no_process(request: pytest.FixtureRequest) -> Any:
    if request.node.path.parent.name != "unit":
        yield
        return
    # torch's first import asks ldconfig where CUDA's libraries are (cuda.pathfinder): a
    # process of torch's, not of the test that happens to import it first
    import torch  # noqa: F401

    PROCESS_WATCH.seen.clear()
    PROCESS_WATCH.on = True
    try:
        yield
    finally:
        PROCESS_WATCH.on = False
    assert not PROCESS_WATCH.seen, ("a unit test started a process (it belongs in "
                                    f"tests/kernel or tests/build): {PROCESS_WATCH.seen}")


# Folders whose tests take longest together (tests/packaging's builds and fresh venvs,
# tests/net's one-at-a-time group, the browser tests' one server), in that order.
LONGEST_FIRST = {"packaging": 0, "net": 1, "browser": 2}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (scripts/test_suite.py), the tests of a module that use a fixture
    kept for the module (``group``, a module's own ``api_group``) go to one worker, so
    that the module starts it once; the others spread over the workers one by one. A
    module that names its own ``xdist_group`` keeps it. The tests of tests/net run one at
    a time on one worker: they make network namespaces, veth pairs on private /30s and
    daemons (sshd, Slurm) of their own, named after their process."""
    # the longest runs first, so that no worker starts one of them near the end
    items.sort(key=lambda item: LONGEST_FIRST.get(item.path.parent.name, len(LONGEST_FIRST)))
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        if item.path.parent.name == "net":
            item.add_marker(pytest.mark.xdist_group("net"))
            continue
        defs = getattr(item, "_fixtureinfo", None)
        ours = [d[-1] for d in defs.name2fixturedefs.values() if d[-1].baseid] if defs else []
        if any(d.scope != "function" for d in ours):  # pytest's own have no baseid
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
