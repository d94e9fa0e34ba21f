"""Partitions and lost hosts: the notebook's kernel (worker0) and a spawned worker1 here,
two headless workers (worker2, worker3) on a second "host": a network namespace with a
hostname of its own (its own UTS namespace, so the kernel has no pid to watch, as across
real hosts), joined by a veth pair (conftest's ``netns``). The link is taken down and
brought back, or the host is lost (the link deleted, its processes killed, the namespace
deleted). Real kernel, real workers, real TensorPipe; skipped with the reason where the
machine does not let the test create a network namespace. Every process is stopped by
pid."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import worker_pids

from rpcnb.procs.processes import kill_all, pid_alive

FAR = ("worker2", "worker3")


def ns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def rows(kernel) -> tuple[dict[str, str], float]:
    """%rpc_workers' rows by name, and how long it took."""
    out = kernel.execute("%rpc_workers", timeout=60)
    table = out.text
    return ({line.split()[0]: line for line in table.splitlines() if line.startswith("worker")},
            out.finished - out.started)


def timed(kernel, code: str, timeout: float = 60):
    out = kernel.execute(code, timeout=timeout, allow_error=True)
    return out, out.finished - out.started


def far_group(kernel, netns, tmp_path) -> tuple[list[subprocess.Popen], dict[str, Path]]:
    """worker0 (the kernel) and worker1 here, worker2 and worker3 on the other host."""
    if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --uts (a hostname for the other host) is not allowed here")
    ns, addr = netns["ns"], netns["addr"]
    kernel.execute("%load_ext rpcnb")
    kernel.execute(f"%rpc_init --workers 1 --port 0 --host {addr} --allow-remote")
    kernel.execute("import rpcnb.session.state, shutil, os\n_s = rpcnb.session.state.current()")
    join = kernel.value("_s.init_method")
    token_file = tmp_path / "connection.json"
    kernel.execute(f"shutil.copy(_s.connection_path, {str(token_file)!r})")
    os.chmod(token_file, 0o600)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    procs: list[subprocess.Popen] = []
    logs = {n: tmp_path / f"{n}.log" for n in FAR}
    for name in FAR:
        with open(logs[name], "wb") as f:
            # the other host: its own network and its own hostname
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                 'hostname far-host && exec "$0" -m rpcnb.worker --join "$1" --token-file "$2" '
                 '--name "$3"', sys.executable, join, str(token_file), name],
                stdout=f, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + 120
    members: dict[str, int] = {}
    while time.monotonic() < deadline and not set(FAR) <= set(members):
        assert all(p.poll() is None for p in procs), \
            "\n".join(p.read_text()[-2000:] for p in logs.values() if p.exists())
        time.sleep(0.5)
        members = worker_pids(kernel)
    assert set(FAR) <= set(members), logs["worker2"].read_text()[-2000:]
    table, _ = rows(kernel)
    assert "far-host" in table["worker2"] and "far-host" not in table["worker1"], table
    return procs, logs


def stop(procs: list[subprocess.Popen], ns: str) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    kill_all([p for p in ns_pids(ns) if pid_alive(p)])


def test_partition_is_not_a_death_and_heals(kernel, netns, tmp_path):
    ns, there = netns["ns"], netns["there"]
    procs, logs = far_group(kernel, netns, tmp_path)
    try:
        kernel.execute("%%remote worker2\nkept = 41")
        # 30 s: it runs on through the partition there, and the later cell waits for it
        kernel.execute("%%remote worker2 --bg -o job\nimport time\n"
                       "for _ in range(300):\n    time.sleep(0.1)\n'finished'")
        time.sleep(1)
        # the cable is pulled at the other host: this host keeps its interface and address
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", there, "down"], check=True)
        cut = time.monotonic()

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

        # %rpc_workers answers in time and marks both far members unreachable, not dead
        table, took = rows(kernel)
        assert took < 5, took
        for name in FAR:
            assert "unreachable since" in table[name] and "no:" not in table[name], table[name]
        assert " yes " in table["worker1"], table["worker1"]
        print(f"%rpc_workers took {took:.1f} s during the partition")

        # the background cell running there ended with that error
        assert kernel.value("job.ready()")
        err = kernel.value("str(job.error())")
        assert "worker2" in err and "unreachable" in err, err
        assert all(p.poll() is None for p in procs), "a far worker exited during the partition"
        partition = time.monotonic() - cut

        # the link is back: the members answer again, on their own, with their namespace
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", there, "up"], check=True)
        back = time.monotonic()
        healed = None
        while time.monotonic() - back < 30:
            table, _ = rows(kernel)
            if all(" yes " in table[n] for n in FAR):
                healed = time.monotonic() - back
                break
            time.sleep(0.5)
        assert healed is not None, table
        print(f"partition of {partition:.0f} s; back {healed:.1f} s after the link came up")
        out, took = timed(kernel, "%%remote worker2 --fetch\nkept + 1")
        assert out.text == "42", out
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
