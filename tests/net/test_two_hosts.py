"""Two network hosts on one machine: the notebook's kernel and a spawned worker in this
network namespace, two headless workers (``python -m rpcnb.worker --join``) in a second
one joined by a veth pair (conftest's ``netns``), all one group over the veth addresses.
Real processes, real TensorPipe, real kernel; skipped with the reason where the machine
does not let the test create a network namespace. Every process is stopped by pid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import Seen, listening_addresses, worker_pids

from rpcnb.procs.processes import kill_all, pid_alive


def in_ns(ns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


def ns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def tcp_sockets(pids: set[int], ns: str | None, listening: bool) -> list[tuple[str, str, int]]:
    """(local, peer, pid) of every TCP socket of ``pids`` as ``ss`` shows it, in ``ns``."""
    cmd = ["ss", "-Htnp", *(["-l"] if listening else ["state", "established"])]
    out = subprocess.run(in_ns(ns, *cmd) if ns else cmd, capture_output=True, text=True,
                         check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        procs = line[line.find("users:"):] if "users:" in line else ""
        for pid in pids:
            if f"pid={pid}," in procs:
                # -l: State Recv-Q Send-Q Local Peer; established: Recv-Q Send-Q Local Peer
                local, peer = (fields[3], fields[4]) if listening else (fields[2], fields[3])
                found.append((local, peer, pid))
    return found


def host_of(addr: str) -> str:
    host = addr.rsplit(":", 1)[0].strip("[]")
    return host.removeprefix("::ffff:")  # an IPv4 address on a v6 socket


def test_members_on_two_hosts(kernel, netns, tmp_path):
    ns, here, there = netns["ns"], netns["here"], netns["there"]
    addr_a = subprocess.run(["ip", "-4", "-o", "addr", "show", here], capture_output=True,
                            text=True).stdout.split()[3].split("/")[0]
    addr_b = addr_a.rsplit(".", 1)[0] + "." + str(int(addr_a.rsplit(".", 1)[1]) + 1)
    kernel.execute("%load_ext rpcnb")
    out = kernel.execute(f"%rpc_init --workers 1 --port 0 --host {addr_a} --allow-remote")
    assert f"the group listens on {addr_a}" in out.stdout
    kernel.execute("import rpcnb.session.state, shutil, os\n_s = rpcnb.session.state.current()")
    join = kernel.value("_s.init_method")
    assert join.startswith(f"tcp://{addr_a}:")
    # the user copies the connection file to the other host (scp): mode 0600
    token_file = tmp_path / "connection.json"
    kernel.execute(f"shutil.copy(_s.connection_path, {str(token_file)!r})")
    os.chmod(token_file, 0o600)
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-secret\n")
    os.chmod(wrong, 0o600)

    env = dict(os.environ, TP_VERBOSE_LOGGING="7", TORCH_CPP_LOG_LEVEL="INFO",
               PYTHONPATH=str(Path(__file__).parents[2]))
    procs: list[subprocess.Popen] = []
    logs = {n: tmp_path / f"{n}.log" for n in ("worker2", "worker3", "outsider")}
    try:
        # a worker without the secret, from the other host: refused, the group unharmed
        outsider = subprocess.run(
            in_ns(ns, sys.executable, "-m", "rpcnb.worker", "--join", join, "--token-file",
                  str(wrong), "--name", "outsider"),
            capture_output=True, text=True, env=env, timeout=120)
        assert outsider.returncode == 2, outsider.stderr[-2000:]
        assert "rpcnb.worker:" in outsider.stderr
        assert "outsider" not in kernel.execute("%rpc_workers").text

        for rank, name in ((2, "worker2"), (3, "worker3")):
            with open(logs[name], "wb") as f:
                # named from the launcher's rank, as under srun or mpiexec
                procs.append(subprocess.Popen(
                    in_ns(ns, sys.executable, "-m", "rpcnb.worker", "--join", join,
                          "--token-file", str(token_file)),
                    stdout=f, stderr=subprocess.STDOUT,
                    env=dict(env, SLURM_PROCID=str(rank - 1))))
        deadline = time.monotonic() + 120
        members: dict[str, int] = {}
        while time.monotonic() < deadline and not {"worker2", "worker3"} <= set(members):
            assert all(p.poll() is None for p in procs), \
                "\n".join(p.read_text()[-2000:] for p in logs.values() if p.exists())
            time.sleep(0.5)
            members = worker_pids(kernel)
        assert {"worker2", "worker3"} <= set(members), logs["worker2"].read_text()[-2000:]
        there_pids = set(ns_pids(ns))
        assert {members["worker2"], members["worker3"]} <= there_pids

        # %rpc_workers shows where each member listens
        table = kernel.execute("%rpc_workers").text
        rows = {line.split()[0]: line for line in table.splitlines() if line.startswith("worker")}
        assert {"worker2", "worker3"} <= set(rows), table
        assert f"{addr_b} ({there})" in rows["worker2"] and f"{addr_b} ({there})" in rows["worker3"]
        assert f"{addr_a} ({here})" in rows["worker0"] and f"{addr_a} ({here})" in rows["worker1"]

        # cells and tensors across the hosts, and between members of the other host
        kernel_ns = kernel.value("os.readlink('/proc/self/ns/net')")
        theirs = kernel.execute("%%remote worker2 --fetch\nimport os\nos.readlink('/proc/self/ns/net')").text
        assert theirs.strip("'") != kernel_ns
        kernel.execute("import torch\nbig = torch.arange(300_000, dtype=torch.float64)")
        got = kernel.execute(
            "%%remote worker2 --push big --fetch\n"
            "import torch\nimport torch.distributed.rpc as rpc\n"
            "a = rpc.rpc_sync('worker3', torch.add, args=(big, 1))\n"
            "b = rpc.rpc_sync('worker1', torch.mul, args=(a, 2))\n"
            "c = rpc.rpc_sync('worker0', torch.sub, args=(b, 2))\n"
            "float(c.sum())").text
        assert float(got) == 2 * float(sum(range(300_000)))
        out = kernel.execute("%%remote worker3\nprint('hello from the other host')")
        assert "hello from the other host" in out.stdout

        # the channel model against TensorPipe's log: TCP (uv) across the namespaces
        predicted = json.loads(kernel.value(
            "__import__('json').dumps({f'{a}->{b}': p.to_dict() for (a, b), p in "
            "__import__('rpcnb.observe.channels').observe.channels.predict_group().items()})"))
        from rpcnb.observe import channels

        observed: dict[tuple[str, str], dict] = {}
        for name in ("worker2", "worker3"):
            for key, seen in channels.observed(logs[name].read_text(errors="replace")).items():
                entry = observed.setdefault(key, {"transport": None, "channels": set()})
                entry["transport"] = seen["transport"] or entry["transport"]
                entry["channels"] |= seen["channels"]
        for pair in (("worker2", "worker3"), ("worker2", "worker0"), ("worker2", "worker1")):
            want = predicted["->".join(pair)]
            assert pair in observed, (pair, sorted(observed))
            assert observed[pair]["transport"] == want["transport"]["name"] == "uv", (pair, want)
            chosen = {c["name"] for c in want["channels"].values()} - {"none"}
            assert observed[pair]["channels"] == chosen, (pair, want, observed[pair])

        # listeners only on the veth addresses and loopback, on both hosts
        here_pids = {kernel.pid, members["worker0"], members["worker1"]}
        for pid in here_pids:
            for listened in listening_addresses(pid):
                assert host_of(listened) in (addr_a, "127.0.0.1", "::1"), (pid, listened)
        for local, _, pid in tcp_sockets(there_pids, ns, listening=True):
            assert host_of(local) in (addr_b, "127.0.0.1", "::1"), (pid, local)
        assert tcp_sockets({members["worker2"]}, ns, listening=True), "worker2 listens nowhere?"
        # and traffic stays on the test's own addresses
        for local, peer, pid in tcp_sockets(there_pids, ns, listening=False):
            assert {host_of(local), host_of(peer)} <= {addr_a, addr_b, "127.0.0.1", "::1"}, \
                (pid, local, peer)
        crossing = [s for s in tcp_sockets(here_pids, None, listening=False)
                    if host_of(s[1]) == addr_b]
        assert crossing, "no connection from this host to the other one"
        for local, peer, _ in tcp_sockets(here_pids, None, listening=False):
            assert {host_of(local), host_of(peer)} <= {addr_a, addr_b, "127.0.0.1", "::1"}

        # %rpc_shutdown: the headless workers leave and exit 0
        kernel.execute("%rpc_shutdown")
        for p in procs:
            p.wait(30)
        assert [p.returncode for p in procs] == [0, 0], logs["worker2"].read_text()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        left = [p for p in ns_pids(ns) if pid_alive(p)]
        kill_all(left)


def test_engines_on_the_other_host_attach(kernel, netns, tmp_path):
    """A cluster the user runs across the two hosts: ipyparallel's controller here on the
    veth address, two engines on the other host (ipengine with the controller's engine
    file, as a user's ssh or batch script would start them)."""
    import ipyparallel as ipp

    ns, here, there = netns["ns"], netns["here"], netns["there"]
    addr_a = subprocess.run(["ip", "-4", "-o", "addr", "show", here], capture_output=True,
                            text=True).stdout.split()[3].split("/")[0]
    addr_b = addr_a.rsplit(".", 1)[0] + "." + str(int(addr_a.rsplit(".", 1)[1]) + 1)
    profile = tmp_path / "profile"
    cluster = ipp.Cluster(n=0, profile_dir=str(profile), controller_ip=addr_a, log_level=40)
    engines: list[subprocess.Popen] = []
    ours = Seen()
    try:
        cluster.start_controller_sync()
        if getattr(cluster.controller, "process", None):
            ours.add(cluster.controller.process.pid)
        engine_file = profile / "security" / f"ipcontroller-{cluster.cluster_id}-engine.json"
        deadline = time.monotonic() + 30
        while not engine_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
        for i in range(2):
            with open(tmp_path / f"engine{i}.log", "wb") as f:
                engines.append(subprocess.Popen(
                    in_ns(ns, sys.executable, "-m", "ipyparallel.engine",
                          f"--file={engine_file}", "--log-level=40"),
                    stdout=f, stderr=subprocess.STDOUT, env=env))
        rc = cluster.connect_client_sync()
        rc.wait_for_engines(2, timeout=90)
        engine_pids = rc[:].apply_sync(os.getpid)
        assert set(engine_pids) <= set(ns_pids(ns))
        rc.close()

        where = f"{profile}:{cluster.cluster_id}"
        kernel.execute("%load_ext rpcnb")
        # a group on loopback cannot take engines on another host: it says what to add
        out = kernel.execute(f"%rpc_init --attach {where}", allow_error=True)
        assert "Engines run on other hosts" in out.traceback and "--allow-remote" in out.traceback
        assert all(p.poll() is None for p in engines)

        kernel.execute(f"%rpc_init --attach {where} --port 0 --host {addr_a} --allow-remote")
        table = kernel.execute("%rpc_workers").text
        rows = {line.split()[0]: line for line in table.splitlines() if line.startswith("worker")}
        for name in ("worker1", "worker2"):
            assert f"{addr_b} ({there})" in rows[name] and " engine " in rows[name], table
        members = worker_pids(kernel)
        assert sorted([members["worker1"], members["worker2"]]) == sorted(engine_pids)

        # %%remote runs in the engine's namespace, the one ipyparallel's client sees
        kernel.execute("import torch\nx = torch.ones(100_000)")
        kernel.execute("%%remote worker2 --push x\ny = x * 5")
        kernel.execute("import rpcnb.integrations.ipyparallel\nrc = rpcnb.integrations.ipyparallel.client()")
        assert kernel.value("float(rc[1].pull('y', block=True).sum())") == 500000.0
        assert kernel.execute("%%remote worker1 --fetch\nfloat(__import__('torch')"
                              ".full((4,), 2.5).sum())").text == "10.0"
        kernel.execute("%rpc_shutdown")
        # the user's engines run on, out of the group
        assert all(p.poll() is None for p in engines)
    finally:
        for p in engines:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        try:
            cluster.stop_cluster_sync()
        except Exception:
            pass
        kill_all([p for p in ns_pids(ns) if pid_alive(p)] + ours.alive())
