"""Faults, each with real processes: the group stays usable (or goes cleanly), and the
surviving namespaces stay intact."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import freeze, pid_alive, worker_pids


@pytest.mark.serial  # a dead worker's cell fails within 2 s
def test_idle_worker_killed_then_a_new_member_joins(own_group, kernel_factory):
    pids = worker_pids(own_group)
    own_group.execute("%%remote worker2\nsurvivor = 'intact'")
    os.kill(pids["worker1"], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while "killed by SIGKILL" not in own_group.execute("%rpc_workers").text:
        assert time.monotonic() < deadline, "the death was not noticed within 5 s"
        time.sleep(0.2)
    t0 = time.monotonic()
    out = own_group.execute("%%remote worker1\n1", allow_error=True)
    assert time.monotonic() - t0 < 2
    assert "Worker 'worker1' died (killed by SIGKILL)" in out.traceback
    assert own_group.execute("%%remote worker2 --fetch\nsurvivor").text == "'intact'"
    # a member joining after the crash is not poisoned by the dead one
    join_line = next(ln.strip() for ln in own_group.execute("%rpc_workers").text.splitlines()
                     if ln.strip().startswith("%rpc_init --join")).replace("NAME", "late")
    late = kernel_factory()
    late.execute("%load_ext rpcnb")
    t0 = time.monotonic()
    late.execute(join_line)
    assert time.monotonic() - t0 < 15
    assert own_group.execute("%%remote late --fetch\n'joined'").text == "'joined'"
    assert late.execute("%%remote worker2 --fetch\nsurvivor").text == "'intact'"
    t0 = time.monotonic()
    own_group.execute("%rpc_shutdown")
    assert time.monotonic() - t0 < 15


def test_frozen_worker_times_out_and_shutdown_is_bounded(own_group):
    pids = worker_pids(own_group)
    freeze(pids["worker1"])
    try:
        t0 = time.monotonic()
        out = own_group.execute("%%remote worker1 --timeout 2\n1", allow_error=True, timeout=30)
        assert time.monotonic() - t0 < 8
        assert "did not finish within 2 s" in out.traceback
        assert "is stopped" in out.stderr  # and the notice said why
        assert own_group.execute("%%remote worker2 --fetch\n'fine'").text == "'fine'"
        t0 = time.monotonic()
        own_group.execute("%rpc_shutdown", timeout=60)
        assert time.monotonic() - t0 < 15
        assert not pid_alive(pids["worker1"]) and not pid_alive(pids["worker2"])
    finally:
        if pid_alive(pids["worker1"]):
            os.kill(pids["worker1"], signal.SIGCONT)


def test_many_concurrent_calls_and_cells_lose_nothing(group):
    out = group.execute(
        "import torch.distributed.rpc as rpc\n"
        "def square(i):\n    return i * i\n"
        "futs = [rpc.rpc_async(f'worker{1 + i % 2}', square, args=(i,)) for i in range(200)]\n"
        "print(all(f.wait() == i * i for i, f in enumerate(futs)))"
    )
    assert out.stdout.strip() == "True"
    cells = group.execute(
        "%%remote --all\nimport sys\nfor i in range(300):\n    print('line', i)\n"
        "    if i % 100 == 0:\n        print('err', i, file=sys.stderr)"
    )
    for w in ("worker1", "worker2"):
        lines = [ln for ln in cells.stdout.splitlines() if ln.startswith(f"[{w}] ")]
        assert lines == [f"[{w}] line {i}" for i in range(300)]
        assert cells.stderr.count(f"[{w}] err") == 3
    # 40 API calls from threads at once, on both workers
    out = group.execute(
        "import rpcnb, concurrent.futures as cf\n"
        "def one(i):\n    return rpcnb.run(f'worker{1 + i % 2}', f'{i} * 2', fetch=True)\n"
        "with cf.ThreadPoolExecutor(40) as ex:\n"
        "    got = list(ex.map(one, range(40)))\n"
        "print(got == [i * 2 for i in range(40)])", timeout=120
    )
    assert out.stdout.strip().endswith("True")


def test_unpicklable_result_and_syntax_error(group):
    group.execute("%%remote worker1\nkeep = 5")
    out = group.execute("%%remote worker1 --fetch\nimport threading\nthreading.Lock()",
                        allow_error=True)
    assert "cannot be sent back" in out.traceback and "Leave out --fetch" in out.traceback
    ok = group.execute("%%remote worker1\nimport threading\nthreading.Lock()")
    assert ok.text.startswith("RRef on worker1: _thread.lock")
    bad = group.execute("%%remote worker1\nx = (1,\ny = 2\n", allow_error=True)
    assert "SyntaxError" in bad.traceback and "<worker1 cell" in bad.traceback
    assert group.execute("%%remote worker1 --fetch\nkeep").text == "5"


def test_join_errors_are_clear_and_leave_nothing(rpcnb_kernel):
    t0 = time.monotonic()
    out = rpcnb_kernel.execute("%rpc_init --join file:///nonexistent/rpcnb/store --name bob",
                         allow_error=True)
    assert time.monotonic() - t0 < 5
    assert "No rpcnb group answers at" in out.traceback
    out = rpcnb_kernel.execute("%rpc_init --join file:///tmp/x --name 'bad name'", allow_error=True)
    assert "not a valid worker name" in out.traceback
    out = rpcnb_kernel.execute("%rpc_init --join file:///tmp/x", allow_error=True)
    assert "--join needs --name" in out.traceback
    assert rpcnb_kernel.value("__import__('rpcnb.api').api.is_initialized()") is False


def test_kernel_restart_stops_the_workers_it_started(own_kernel_group):
    pids = worker_pids(own_kernel_group)
    own_kernel_group.km.restart_kernel(now=True)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(
            pid_alive(pids[n]) for n in ("worker1", "worker2")):
        time.sleep(0.1)
    assert not any(pid_alive(pids[n]) for n in ("worker1", "worker2"))
    # the restarted kernel starts a new group as if nothing happened
    own_kernel_group.pid = own_kernel_group.km.provisioner.pid
    own_kernel_group.known.add(own_kernel_group.pid)
    own_kernel_group.kc.wait_for_ready(timeout=60)
    own_kernel_group.execute("%load_ext rpcnb")
    own_kernel_group.execute("%rpc_init --workers 1")
    assert own_kernel_group.execute("%%remote worker1 --fetch\n'fresh'").text == "'fresh'"
    own_kernel_group.execute("%rpc_shutdown")


def test_joined_kernel_leaves_when_the_first_kernel_dies(own_kernel_group, kernel_factory):
    join_line = next(ln.strip() for ln in own_kernel_group.execute("%rpc_workers").text.splitlines()
                     if ln.strip().startswith("%rpc_init --join")).replace("NAME", "bob")
    bob = kernel_factory()
    bob.execute("%load_ext rpcnb\nkept = 'mine'")
    bob.execute(join_line)
    os.kill(own_kernel_group.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while bob.value("__import__('rpcnb.api').api.is_initialized()"):
        assert time.monotonic() < deadline, "the joined kernel did not notice"
        time.sleep(0.3)
    assert bob.value("kept") == "mine"  # its own namespace is untouched
    bob.execute("%rpc_init --workers 1")  # and it can start a group of its own
    assert bob.execute("%%remote worker1 --fetch\n'new group'").text == "'new group'"
    bob.execute("%rpc_shutdown")


def test_a_member_that_answers_again_shows_alive_again(group):
    # SIGSTOP: the worker is alive but cannot answer; %rpc_workers says so, and once it
    # runs again it is listed alive again (it did not die)
    pids = worker_pids(group)
    freeze(pids["worker1"])
    try:
        stopped = group.execute("%rpc_workers", timeout=60).text
        row = next(ln for ln in stopped.splitlines() if ln.startswith("worker1 "))
        assert "not answering" in row, stopped
    finally:
        os.kill(pids["worker1"], signal.SIGCONT)
    again = group.execute("%rpc_workers").text
    row = next(ln for ln in again.splitlines() if ln.startswith("worker1 "))
    assert " yes " in row and "not answering" not in row, again
    assert group.execute("%%remote worker1 --fetch\n'back'").text == "'back'"


def test_every_member_answers_right_after_init_30_times(rpcnb_kernel):
    # a started worker joins torch's group before it has set itself up; rpcnb lists it
    # only once it has registered, so the first %rpc_workers never sees a half-made one
    for cycle in range(30):
        table = rpcnb_kernel.execute("%rpc_init --workers 2").stdout
        rows = [ln for ln in table.splitlines() if ln.startswith("worker")]
        assert len(rows) == 3, (cycle, table)
        assert all(" yes " in row for row in rows), (cycle, table)
        assert "not answering" not in table, (cycle, table)
        rpcnb_kernel.execute("%rpc_shutdown")


def test_awkward_exceptions_and_results_leave_the_worker_alive(group):
    group.execute("%%remote worker1\nkeep = 'kept'")
    # a cell raising an exception whose __str__ raises (it aborted the worker)
    out = group.execute("%%remote worker1\nclass Odd(Exception):\n"
                        "    def __str__(self):\n        raise ValueError('no')\nraise Odd()",
                        allow_error=True)
    assert "Odd on worker1" in out.traceback and "Odd: <exception str() failed>" in out.traceback
    assert group.execute("%%remote worker1 --fetch\nkeep").text == "'kept'"
    # plain calls raising what torch cannot report, or returning what cannot be pickled
    out = group.execute(
        "import threading, torch.distributed.rpc as rpc\n"
        "class Bad(Exception):\n"
        "    def __str__(self):\n        raise ValueError('no str')\n"
        "    def __repr__(self):\n        raise ValueError('no repr')\n"
        "class Locked(Exception):\n"
        "    def __init__(self):\n        super().__init__('locked')\n"
        "        self.lock = threading.Lock()\n"
        "def raise_bad():\n    raise Bad()\n"
        "def raise_locked():\n    raise Locked()\n"
        "def gen():\n    return (i for i in range(3))\n"
        "def lock():\n    return threading.Lock()\n"
        "for f in (raise_bad, raise_locked, gen, lock):\n"
        "    try:\n        rpc.rpc_sync('worker1', f)\n"
        "    except Exception as e:\n        print(f.__name__, '|', str(e).splitlines()[0:3])\n")
    lines = dict(ln.split(" | ", 1) for ln in out.stdout.splitlines())
    assert "raise_bad raised Bad on worker1, which cannot be sent back" in lines["raise_bad"]
    assert "raise_locked raised Locked on worker1" in lines["raise_locked"]
    assert "A generator cannot be sent to another process" in lines["gen"]
    assert "A _thread.lock cannot be sent to another process" in lines["lock"]
    assert group.execute("%%remote worker1 --fetch\nkeep").text == "'kept'"
    assert group.execute("%%remote worker2 --fetch\n'fine'").text == "'fine'"


def test_push_of_a_value_that_cannot_be_sent_names_it(group):
    group.execute("import threading\nlock = threading.Lock()\nx = 1")
    out = group.execute("%%remote worker1 --push x,lock\nx", allow_error=True)
    assert out.traceback.startswith("UsageError: --push: 'lock' (a lock) cannot be sent")
    assert group.execute("%%remote worker1 --push x --fetch\nx + 1").text == "2"


def test_many_short_threads_calling_run_do_not_pile_up_descriptors(group):
    out = group.execute(
        "import os, threading, rpcnb\n"
        "def fds():\n    return len(os.listdir('/proc/self/fd'))\n"
        "rpcnb.run('worker1', 'None')\n"
        "before = fds()\n"
        "for _ in range(300):\n"
        "    t = threading.Thread(target=rpcnb.run, args=('worker1', 'None'))\n"
        "    t.start()\n    t.join()\n"
        "print(fds() - before)", timeout=180)
    assert int(out.stdout.strip()) < 30


def test_a_thread_left_by_an_earlier_cell_prints_to_the_background(group):
    group.execute("%%remote worker1\nimport threading, time\n"
                  "def later():\n    time.sleep(0.8)\n    print('from an old thread')\n"
                  "threading.Thread(target=later).start()")
    out = group.execute("%%remote worker1\nimport time\nprint('mine')\ntime.sleep(1.5)\n"
                        "print('mine too')")
    assert "mine\nmine too\n" in out.stdout.replace("[worker1] from an old thread\n", "")
    assert "from an old thread" not in out.stdout.replace("[worker1] from an old thread", "")
