"""Partitions and lost hosts: the notebook's kernel (worker0) and a spawned worker1 here,
two headless workers (worker2, worker3) on a second "host": a network namespace with a
hostname of its own (its own UTS namespace, so the kernel has no pid to watch, as across
real hosts), joined by a veth pair (conftest's ``netns``). The link is taken down and
brought back, or the host is lost (the link deleted, its processes killed, the namespace
deleted). Real kernel, real workers, real TensorPipe; skipped with the reason where the
machine does not let the test create a network namespace. Every process is stopped by
pid."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from conftest import worker_pids
from hosts import FAR, far_group, rows, stop, timed

from rpcnb.procs.processes import pid_alive

IN_FLIGHT = """
import threading, time
import torch.distributed.rpc as rpc
in_flight = {}

def _sync():
    try:
        rpc.rpc_sync("worker2", time.sleep, args=(25,))
        in_flight["rpc_sync"] = ("no error", time.time())
    except Exception as exc:
        in_flight["rpc_sync"] = (repr(exc), time.time())

def _async_done(f):
    try:
        f.wait()
        in_flight["rpc_async"] = ("no error", time.time())
    except Exception as exc:
        in_flight["rpc_async"] = (repr(exc), time.time())

th = threading.Thread(target=_sync, daemon=True)
th.start()
fut = rpc.rpc_async("worker2", time.sleep, args=(25,))
fut.add_done_callback(_async_done)
"""


def test_partition_is_not_a_death_and_heals(kernel, netns, tmp_path):
    ns, there = netns["ns"], netns["there"]
    procs, logs = far_group(kernel, netns, tmp_path)
    try:
        kernel.execute("%%remote worker2\nkept = 41")
        # 30 s: it runs on through the partition there, and the later cell waits for it
        kernel.execute("%%remote worker2 --bg -o job\nimport time\n"
                       "for _ in range(300):\n    time.sleep(0.1)\n'finished'")
        # plain torch calls in flight when the link goes down: one rpc_sync (on a thread),
        # one rpc_async; each sleeps 25 s there
        kernel.execute(IN_FLIGHT)
        time.sleep(1)
        # the cable is pulled at the other host: this host keeps its interface and address
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", there, "down"], check=True)
        cut, cut_wall = time.monotonic(), time.time()

        # a call to the unreachable member fails in time, naming it, saying since when
        out, took = timed(kernel, "%%remote worker2 --fetch\nkept")
        assert out.error, out
        said = out.traceback
        assert took < 10, (took, said)
        assert "worker2" in said and "unreachable" in said and "since" in said, said
        assert "WorkerUnreachableError" in said and "process is gone" not in said, said
        print(f"call to worker2 failed {took:.1f} s after the link went down")

        # the others answer at once
        out, took = timed(kernel, "%%remote worker1 --fetch\n6 * 7")
        assert out.text == "42" and took < 2, (out, took)
        # a plain torch call to it fails at once, saying so, not after torch's 60 s
        out, took = timed(kernel, "import os, torch.distributed.rpc as rpc\n"
                                  "rpc.rpc_sync('worker2', os.getpid)")
        assert out.error and "WorkerUnreachableError" in out.traceback, out
        assert "worker2" in out.traceback and took < 2, (took, out.traceback)
        # a cell sent to all: the unreachable ones fail it, worker1's result is kept
        out, took = timed(kernel, "%%remote --all --fetch\n6 * 7")
        assert out.error and "unreachable" in out.traceback, out
        assert "worker1 finished" in out.traceback and "{'worker1': 42}" in out.traceback, out
        assert took < 10, took

        # %rpc_workers answers in time and marks both far members unreachable, not dead
        table, took = rows(kernel)
        assert took < 5, took
        for name in FAR:
            assert "unreachable since" in table[name] and "no:" not in table[name], table[name]
        assert " yes " in table["worker1"], table["worker1"]
        print(f"%rpc_workers took {took:.1f} s during the partition")

        # the plain calls in flight ended with that error, within 10 s, not torch's 60 s
        kernel.execute("th.join(20)")
        got = kernel.value("in_flight")
        for way in ("rpc_sync", "rpc_async"):
            said, at = got[way]
            assert "WorkerUnreachableError" in said and "worker2" in said, (way, said)
            assert at - cut_wall < 10, (way, at - cut_wall)
            print(f"{way} in flight failed {at - cut_wall:.1f} s after the link went down")

        # the background cell running there ended with that error
        assert kernel.value("job.ready()")
        err = kernel.value("str(job.error())")
        assert "worker2" in err and "unreachable" in err, err
        assert all(p.poll() is None for p in procs), "a far worker exited during the partition"

        # a new member cannot join now (torch's join asks every member): said at once
        out, took = timed(kernel, "%rpc_init --add 1")
        assert "cannot be reached now" in out.stderr and "worker2" in out.stderr, out
        assert took < 5, took
        partition = time.monotonic() - cut

        # the link is back: the members answer again, on their own, with their namespace
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", there, "up"], check=True)
        back = time.monotonic()
        healed, said = None, ""
        while time.monotonic() - back < 30:
            out = kernel.execute("%rpc_workers", timeout=60)
            said += out.stderr
            table = {ln.split()[0]: ln for ln in out.text.splitlines() if ln.startswith("worker")}
            if all(" yes " in table[n] for n in FAR):
                healed = time.monotonic() - back
                break
            time.sleep(0.5)
        assert healed is not None, table
        # the notebook hears of it (not only the terminal), once
        out = kernel.execute("%rpc_workers", timeout=60)
        said += out.stderr
        for name in FAR:
            assert said.count(f"rpcnb: {name} answers again, with its namespace") == 1, said
        print(f"partition of {partition:.0f} s; back {healed:.1f} s after the link came up")
        out, took = timed(kernel, "%%remote worker2 --fetch\nkept + 1")
        assert out.text == "42", out
        assert isinstance(kernel.value("rpc.rpc_sync('worker2', os.getpid)"), int)
        out, took = timed(kernel, "%rpc_init --add 1", timeout=120)
        assert not out.error and "worker4" in out.text + out.stdout, out
        kernel.execute("import rpcnb")
        assert kernel.value("rpcnb.run('worker4', '6 * 7', fetch=True)") == 42
        out = kernel.execute("%%remote worker3 --fetch\n'still here'")
        assert "still here" in out.text
        assert all(p.poll() is None for p in procs)

        kernel.execute("%rpc_shutdown", timeout=60)
        for p in procs:
            p.wait(30)
        assert [p.returncode for p in procs] == [0, 0], logs["worker2"].read_text()[-2000:]
    finally:
        stop(procs, ns)


def test_lost_host(kernel, netns, tmp_path):
    ns, there = netns["ns"], netns["there"]
    procs, _ = far_group(kernel, netns, tmp_path)
    try:
        group_dir = kernel.value("str(_s.group_dir)")
        worker1 = worker_pids(kernel)["worker1"]
        # the host is lost: its link first (nothing it says reaches us), then its processes,
        # then the namespace (its end of the veth pair taken out first, so that this host
        # keeps its interface and address, as a host keeps its NIC when another one dies)
        in_ns = ["ip", "netns", "exec", ns]
        subprocess.run([*in_ns, "ip", "link", "set", there, "down"], check=True)
        stop(procs, ns)
        subprocess.run([*in_ns, "ip", "link", "set", there, "netns", "1"], check=True)
        subprocess.run(["ip", "netns", "del", ns], check=True)

        for name in FAR:
            out, took = timed(kernel, f"%%remote {name} --fetch\n1")
            assert out.error and name in out.traceback, out
            assert took < 10, (name, took, out.traceback)
            print(f"call to {name} failed after {took:.1f} s")
        out, took = timed(kernel, "%%remote worker1 --fetch\n6 * 7")
        assert out.text == "42" and took < 2, (out, took)

        out, took = timed(kernel, "%rpc_shutdown")
        assert not out.error, out.traceback
        assert took < 15, took
        print(f"%rpc_shutdown took {took:.1f} s")
        assert kernel.value("__import__('rpcnb').session.state.active() is None")
        assert not Path(group_dir).exists()
        deadline = time.monotonic() + 5
        while pid_alive(worker1) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(worker1)
        # a new group starts as usual (on the same interface: torch keeps the first)
        kernel.execute(f"%rpc_init --workers 1 --port 0 --host {netns['addr']} --allow-remote")
        assert kernel.execute("%%remote worker1 --fetch\n2 + 2").text == "4"
        kernel.execute("%rpc_shutdown")
    finally:
        stop(procs, ns)
