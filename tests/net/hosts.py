"""A second "host" for the tests in tests/net: headless workers joined from another
network namespace with a hostname of its own (``far_group``), stopped by pid (``stop``);
and a link to that namespace that is slow and lossy (``slow_link``): ``tc netem`` on a
veth pair where the kernel has it, else a user-space link between two TAP devices
(``linkemu.py``) with the same delay, loss and rate."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import netns_blocker, worker_pids

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


def far_group(kernel, netns, tmp_path, names: tuple[str, ...] = FAR, init: str = "",
              own_pids: bool = False, worker_args: tuple[str, ...] = ()
              ) -> tuple[list[subprocess.Popen], dict[str, Path]]:
    """worker0 (the kernel) and worker1 here, ``names`` on the other host (``init``: more
    flags for %rpc_init; ``worker_args``: for ``python -m rpcnb.worker``). ``own_pids``:
    the other host has its own pid namespace too, so that TensorPipe cannot take CMA
    (process_vm_readv) to it and every byte crosses the link, as between real hosts."""
    unshare = ["unshare", "--uts", *(["--pid", "--fork", "--mount-proc"] if own_pids else [])]
    if subprocess.run([*unshare, "true"], capture_output=True).returncode != 0:
        pytest.skip(f"{' '.join(unshare)} (a hostname, pids for the other host) is not "
                    "allowed here")
    ns, addr = netns["ns"], netns["addr"]
    kernel.execute("%load_ext rpcnb")
    kernel.execute(f"%rpc_init --workers 1 --port 0 --host {addr} --allow-remote {init}")
    kernel.execute("import rpcnb.session.state, shutil, os\n_s = rpcnb.session.state.current()")
    join = kernel.value("_s.init_method")
    token_file = tmp_path / "connection.json"
    kernel.execute(f"shutil.copy(_s.connection_path, {str(token_file)!r})")
    os.chmod(token_file, 0o600)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    procs: list[subprocess.Popen] = []
    logs = {n: tmp_path / f"{n}.log" for n in names}
    for name in names:
        with open(logs[name], "wb") as f:
            # the other host: its own network and its own hostname
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, *unshare, "sh", "-c",
                 'hostname far-host && exec "$0" -m rpcnb.worker --join "$1" --token-file "$2" '
                 '--name "$3" ' + " ".join(map(shlex.quote, worker_args)),
                 sys.executable, join, str(token_file), name],
                stdout=f, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + 120
    members: dict[str, int] = {}
    while time.monotonic() < deadline and not set(names) <= set(members):
        assert all(p.poll() is None for p in procs), \
            "\n".join(p.read_text()[-2000:] for p in logs.values() if p.exists())
        time.sleep(0.5)
        members = worker_pids(kernel)
    assert set(names) <= set(members), logs[names[0]].read_text()[-2000:]
    table, _ = rows(kernel)
    assert "far-host" in table[names[0]] and "far-host" not in table["worker1"], table
    return procs, logs


def stop(procs: list[subprocess.Popen], ns: str) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    kill_all([p for p in ns_pids(ns) if pid_alive(p)])


# -- a slow, lossy link ------------------------------------------------------------------

LINKEMU = Path(__file__).with_name("linkemu.py")


def _tc_blocker() -> str | None:
    if os.geteuid() == 0 and shutil.which("tc") is None:
        return "the 'tc' command (iproute2) is not installed"
    return netns_blocker()


def netem_works() -> bool:
    """Whether this kernel has ``sch_netem`` (tc's netem qdisc)."""
    link = f"rpq{os.getpid() % 100000}"
    if subprocess.run(["ip", "link", "add", f"{link}a", "type", "veth", "peer", "name",
                       f"{link}b"], capture_output=True).returncode != 0:
        return False
    try:
        return subprocess.run(["tc", "qdisc", "add", "dev", f"{link}a", "root", "netem",
                               "delay", "1ms"], capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "link", "del", f"{link}a"], capture_output=True)


@contextlib.contextmanager
def slow_link(ns: str, link: str, net: str, delay: float = 0.02, loss: float = 0.01,
              rate: float = 0.0) -> Iterator[dict[str, object]]:
    """Namespace ``ns`` with ``{link}b`` at ``{net}.2``, joined to ``{link}a`` here at
    ``{net}.1`` by a link that delays each frame ``delay`` seconds and loses ``loss`` of
    them, each way, at ``rate`` bytes per second at most (0: no limit). ``"how"`` says
    which: "netem" or "linkemu" (the kernel has no netem). Everything is removed at the end,
    the emulator stopped by pid."""
    why = _tc_blocker()
    if why:
        pytest.skip(why)
    here, there = f"{link}a", f"{link}b"
    in_ns = ["ip", "netns", "exec", ns]
    emu: subprocess.Popen | None = None
    try:
        if netem_works():
            how = "netem"
            subprocess.run(["ip", "link", "add", here, "type", "veth", "peer", "name", there],
                           check=True, capture_output=True)
            shape = ["netem", "delay", f"{delay * 1000:g}ms", "loss", f"{loss * 100:g}%"]
            if rate:
                shape += ["rate", f"{int(rate * 8)}bit"]
        else:
            how, shape = "linkemu", []
            if not os.path.exists("/dev/net/tun"):
                pytest.skip("this kernel has no tc netem and no /dev/net/tun for a slow link")
            emu = subprocess.Popen([sys.executable, str(LINKEMU), here, there, "--delay",
                                    str(delay), "--loss", str(loss), "--rate", str(rate)],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert emu.stdout is not None
            first = emu.stdout.readline()
            assert first.strip() == "ready", first + emu.stdout.read()
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        for step in (["ip", "link", "set", there, "netns", ns],
                     ["ip", "addr", "add", f"{net}.1/30", "dev", here],
                     ["ip", "link", "set", here, "up"],
                     [*in_ns, "ip", "addr", "add", f"{net}.2/30", "dev", there],
                     [*in_ns, "ip", "link", "set", there, "up"],
                     [*in_ns, "ip", "link", "set", "lo", "up"]):
            subprocess.run(step, check=True, capture_output=True)
        if shape:  # both ends, as each direction of a real link is delayed and lossy
            subprocess.run(["tc", "qdisc", "add", "dev", here, "root", *shape], check=True)
            subprocess.run([*in_ns, "tc", "qdisc", "add", "dev", there, "root", *shape],
                           check=True)
        yield {"ns": ns, "here": here, "there": there, "addr": f"{net}.1", "how": how,
               "emulator": emu}
    finally:
        # whatever still runs on the other host (a join that failed half-way), by pid
        kill_all([p for p in ns_pids(ns) if pid_alive(p)])
        if emu is not None and emu.poll() is None:
            emu.kill()
            emu.wait(5)
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
