"""Start-up through the warm launcher: workers forked by a process that imported torch
once, started before the kernel imports torch; a re-init after %rpc_shutdown reuses it;
it ends with the kernel; a failed start still says why at once. Real kernels, real
workers, real torch RPC; timings are bench/startup.py's, not asserted here."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from conftest import Seen, children_of, pid_alive, wait_until, worker_pids

LAUNCHER = "__import__('rpcnb.procs.launch').procs.launch.current_launcher()"


def ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def launcher_pid(k) -> int:
    return int(k.value(f"{LAUNCHER}.pid"))


def test_warm_reinit_forks_from_the_launcher_and_gives_a_working_group(kernel):
    kernel.execute("%load_ext rpcnb")
    assert kernel.value(f"{LAUNCHER} is None")  # nothing before the first group
    kernel.execute("%rpc_init --workers 2")
    launcher = launcher_pid(kernel)
    first = worker_pids(kernel)
    for name in ("worker1", "worker2"):
        assert ppid(first[name]) == launcher
        assert comm(first[name]) == f"rpcnb {name}"
    assert ppid(launcher) == kernel.pid

    kernel.execute("%rpc_shutdown")
    assert wait_until(lambda: not any(pid_alive(first[n]) for n in ("worker1", "worker2")))
    assert pid_alive(launcher)  # it stays, warm

    kernel.execute("%rpc_init --workers 2")
    assert launcher_pid(kernel) == launcher
    again = worker_pids(kernel)
    for name in ("worker1", "worker2"):
        assert again[name] != first[name]
        assert ppid(again[name]) == launcher
    # a working group: an RRef made on worker1 travels to worker2 and back to the kernel
    kernel.execute("%%remote worker1 -o r\nimport torch\ntorch.arange(4) * 2")
    assert kernel.value("r.to_here().tolist()") == [0, 2, 4, 6]
    out = kernel.execute("%%remote worker2 --push r --fetch\nint(r.to_here().sum())")
    assert out.text == "12"
    # each forked worker has its own state: its own pid, a namespace of its own
    kernel.execute("%%remote worker1\nmine = 1")
    out = kernel.execute("%%remote worker2 --fetch\n'mine' in globals()")
    assert out.text == "False"
    kernel.execute("%rpc_init --add 1")
    assert ppid(worker_pids(kernel)["worker3"]) == launcher
    kernel.execute("%rpc_shutdown")


def test_the_launcher_is_fork_safe_and_keeps_the_secret_off_command_lines(kernel):
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 1")
    facts = kernel.value(f"{LAUNCHER}.ask_facts()")
    assert facts["cuda_initialized"] is False
    assert facts["python_threads"] == 1  # a fork copies only the forking thread
    launcher = facts["pid"]
    secret = kernel.value("__import__('rpcnb.session.state').session.state.current().secret")
    pids = worker_pids(kernel)
    for pid in (launcher, pids["worker1"]):
        assert secret not in Path(f"/proc/{pid}/cmdline").read_text()
        assert secret.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    # the launcher listens on nothing: its only way in is the kernel's pipe
    sockets = [os.readlink(f) for f in Path(f"/proc/{launcher}/fd").iterdir()
               if os.readlink(f).startswith("socket:")]
    assert sockets == []
    # TensorPipe in a forked worker listens on loopback, as in a fresh one
    from conftest import listening_addresses

    addrs = listening_addresses(pids["worker1"])
    assert addrs and all(a.startswith("127.0.0.1:") for a in addrs), addrs
    kernel.execute("%rpc_shutdown")


def test_a_kernel_interrupt_misses_the_workers_which_share_its_session(kernel):
    """Jupyter interrupts a kernel with a SIGINT to the kernel's process group: the
    launcher and each worker are in a group of their own, so it reaches none of them. They
    stay in the kernel's session: Linux's scheduler shares the CPU between sessions
    (autogroup), and workers in sessions of their own ran a CPU-bound RPC program 1.2x
    slower on two cores (docs/benchmarks.md)."""
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 2")
    kernel.execute("%%remote --all\nkept = 41")
    members = worker_pids(kernel)
    ours = [launcher_pid(kernel), members["worker1"], members["worker2"]]
    group = os.getpgid(kernel.pid)
    assert group != os.getpgid(0)  # the kernel's own group, not pytest's
    for pid in ours:
        assert os.getsid(pid) == os.getsid(kernel.pid), pid
        assert os.getpgid(pid) == pid, pid  # a group of its own
    # each worker waits in a background cell that says whether a SIGINT reached it
    kernel.execute("%%remote --all --bg -o h\nimport time\ntry:\n    time.sleep(4)\n"
                   "    said = 'slept'\nexcept KeyboardInterrupt:\n    said = 'interrupted'")
    assert wait_until(lambda: kernel.value("h.status") == "running", timeout=10)
    # the kernel is in a cell of its own when the signal comes: that cell ending with a
    # KeyboardInterrupt is the signal's arrival at the kernel's process group
    msg_id = kernel.kc.execute("import time\nprint('waiting', flush=True)\ntime.sleep(60)",
                               stop_on_error=False)  # the next cells are not dropped
    assert kernel.later(msg_id, until=lambda ms: any(
        m["msg_type"] == "stream" for m in ms), timeout=30)
    os.killpg(group, signal.SIGINT)  # what jupyter_client's interrupt_kernel sends
    assert kernel.later(msg_id, until=lambda ms: any(
        m["msg_type"] == "error" and m["content"]["ename"] == "KeyboardInterrupt" for m in ms),
        timeout=30)
    assert all(pid_alive(pid) for pid in ours)
    assert kernel.value("h.wait(30)") is True
    assert kernel.execute("%%remote --all --fetch\nsaid").text == \
        "{'worker1': 'slept', 'worker2': 'slept'}"
    for name in ("worker1", "worker2"):
        assert kernel.execute(f"%%remote {name} --fetch\nkept + 1").text == "42"
    kernel.execute("%rpc_shutdown")


def _ends_with_the_kernel(kernel_factory, how: str) -> None:
    k = kernel_factory()
    k.execute("%load_ext rpcnb")
    k.execute("%rpc_init --workers 2")
    launcher = launcher_pid(k)
    pids = [p for n, p in worker_pids(k).items() if n != "worker0"]
    group_dir = Path(k.value("str(__import__('rpcnb.session.state').session.state.current().group_dir)"))
    if how == "kill":
        os.kill(k.pid, signal.SIGKILL)
    else:
        k.kc.stop_channels()
        k.km.shutdown_kernel(now=False)  # a clean shutdown, the group still up
    assert wait_until(lambda: not any(pid_alive(p) for p in [launcher, *pids]), timeout=15), \
        [p for p in [launcher, *pids] if pid_alive(p)]
    assert wait_until(lambda: not group_dir.exists(), timeout=5)


def test_launcher_and_workers_end_when_the_kernel_is_killed(kernel_factory):
    _ends_with_the_kernel(kernel_factory, "kill")


def test_launcher_and_workers_end_when_the_kernel_shuts_down(kernel_factory):
    _ends_with_the_kernel(kernel_factory, "shutdown")


def test_a_worker_killed_while_it_starts_fails_the_start_at_once(kernel):
    import threading

    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 1")
    kernel.execute("%rpc_shutdown")
    launcher = launcher_pid(kernel)
    got: dict = {}
    cell = threading.Thread(target=lambda: got.update(
        out=kernel.execute("%rpc_init --workers 2", allow_error=True)))
    cell.start()
    victim = None
    deadline = time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:
        for pid in children_of(launcher):
            try:
                if comm(pid) == "rpcnb worker2":
                    victim = pid
            except OSError:
                pass
        time.sleep(0.002)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)  # as the OOM killer would
    killed = time.monotonic()
    cell.join(120)
    out = got["out"]
    assert "Worker 'worker2' failed to start (killed by SIGKILL)" in out.traceback
    assert out.finished - killed < 10  # the launcher reported it; no start timeout
    # everything that started was stopped, and the next start works
    assert wait_until(lambda: children_of(launcher) == [], timeout=10)
    assert kernel.value("__import__('rpcnb.session.state').session.state.is_initialized()") is False
    kernel.execute("%rpc_init --workers 1")
    assert kernel.execute("%%remote worker1 --fetch\n6 * 7").text == "42"
    kernel.execute("%rpc_shutdown")


def test_a_launcher_that_cannot_start_says_why_at_once(kernel, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "cloudpickle.py").write_text("raise ImportError('cloudpickle broken on purpose')\n")
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 1")
    kernel.execute("%rpc_shutdown")
    old = launcher_pid(kernel)
    # a variable read when Python starts changed: the launcher is replaced, and the new
    # one cannot import what a worker needs
    kernel.execute(f"import os; os.environ['PYTHONPATH'] = {str(broken)!r}")
    t0 = time.monotonic()
    out = kernel.execute("%rpc_init --workers 2", allow_error=True)
    assert time.monotonic() - t0 < 60  # well before the 120 s start timeout
    assert "could not be started" in out.traceback
    assert "cloudpickle broken on purpose" in out.traceback
    assert not pid_alive(old)
    assert kernel.value("__import__('rpcnb.session.state').session.state.is_initialized()") is False
    kernel.execute("del os.environ['PYTHONPATH']")
    kernel.execute("%rpc_init --workers 1")
    assert kernel.execute("%%remote worker1 --fetch\n1 + 1").text == "2"
    kernel.execute("%rpc_shutdown")


def test_a_killed_or_replaced_launcher_leaves_the_group_alone(kernel):
    """The launcher is a helper: killing it (by hand, the OOM killer) or a changed
    load-time variable that replaces it does not take the running workers with it, and
    the next start gets a fresh launcher."""
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 2")
    first = launcher_pid(kernel)
    before = worker_pids(kernel)
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: not pid_alive(first))
    # the workers have seen it go (they were handed to another parent, when a parent-death
    # signal would have come), and what their watch asks (is the kernel alive?) holds there
    assert wait_until(lambda: all(ppid(before[n]) != first for n in ("worker1", "worker2")))
    assert kernel.execute(
        f"%%remote --all --fetch\nfrom rpcnb.procs import processes\n"
        f"processes.pid_alive({kernel.pid})").text == "{'worker1': True, 'worker2': True}"
    assert all(pid_alive(before[n]) for n in ("worker1", "worker2"))
    assert kernel.execute("%%remote --all --fetch\n6 * 7").text == \
        "{'worker1': 42, 'worker2': 42}"
    kernel.execute("%rpc_init --add 1")  # a fresh launcher forks worker3
    second = launcher_pid(kernel)
    assert second != first
    assert ppid(worker_pids(kernel)["worker3"]) == second
    # a load-time variable changed: the next start replaces the launcher, the group stays
    kernel.execute("import os\nos.environ['OMP_NUM_THREADS'] = '1'")
    kernel.execute("%rpc_init --add 1")
    third = launcher_pid(kernel)
    assert third != second and not pid_alive(second)
    assert kernel.execute("%%remote --all --fetch\n6 * 7").text == \
        "{'worker1': 42, 'worker2': 42, 'worker3': 42, 'worker4': 42}"
    # a worker forked by a launcher that is gone is still seen to die, and is named
    def worker1_row() -> str:
        return next(row for row in kernel.execute("%rpc_workers").text.splitlines()
                    if "worker1" in row)

    assert " yes " in worker1_row()  # the alive column
    os.kill(before["worker1"], signal.SIGKILL)
    assert wait_until(lambda: " yes " not in worker1_row(), timeout=5)
    out = kernel.execute("%%remote worker1\n1", allow_error=True)
    assert "Worker 'worker1' died" in out.traceback
    assert kernel.execute("%%remote worker2 --fetch\n6 * 7").text == "42"
    kernel.execute("%rpc_shutdown")
    assert wait_until(lambda: not pid_alive(before["worker2"]))


TERMINAL_DRIVER = r"""
import os
import rpcnb

def terminal():
    try:
        os.close(os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY))
        return "terminal"
    except OSError:
        return "none"

rpcnb.init(1)
where = rpcnb.run("worker1", "import os\ntry:\n    os.close(os.open('/dev/tty', os.O_RDWR | os.O_NOCTTY))\n"
                  "    r = 'terminal'\nexcept OSError:\n    r = 'none'\nr", fetch=True)
print("RESULT", terminal(), where, os.getsid(0) == os.getsid(rpcnb.group().members[1].pid),
      flush=True)
rpcnb.shutdown()
"""


def test_workers_of_a_driver_in_a_terminal_leave_the_terminal():
    """A plain-Python driver run from a shell has a controlling terminal; its workers, in
    its session but in background process groups, must not keep it: a read of /dev/tty
    there (getpass, an ssh or sudo prompt in a cell) would stop the worker for good
    (SIGTTIN). They give it up, and stay in the session."""
    import pty
    import select
    import sys

    from rpcnb.procs.processes import kill_all

    pid, fd = pty.fork()  # the child: a session leader with the pty as its terminal
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-c", TERMINAL_DRIVER])
    seen = Seen()
    text = b""
    try:
        deadline = time.monotonic() + 180
        while b"RESULT" not in text or not text.rstrip().endswith((b"True", b"False")):
            seen.update(children_of(pid))
            if time.monotonic() > deadline:
                break
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                try:
                    text += os.read(fd, 4096)
                except OSError:  # the driver ended and closed the pty
                    break
        line = next((ln for ln in text.decode(errors="replace").splitlines()
                     if ln.startswith("RESULT")), "")
        # the driver has the terminal; its worker has none, in the driver's session
        assert line.split() == ["RESULT", "terminal", "none", "True"], text[-3000:]
    finally:
        seen.kill()
        kill_all([pid])  # the driver: this process's child, its pid its own until reaped
        os.close(fd)
        os.waitpid(pid, 0)
