"""Strangers' bytes across hosts: a group of the notebook's kernel (worker0) and a spawned
worker1 on this host, worker2 and worker3 on a second "host" (conftest's ``netns``), and a
third host that is not in the group (a namespace of its own, joined to this one by another
veth pair). From that third host a stranger scans every port the kernel and worker1
listen on, sends each one junk, zeros, 0xff, an HTTP request and a TLS hello, and holds
connections open half-way. Unfenced, the first of these aborts a member (TensorPipe:
``std::bad_alloc``). Real kernel, real workers, real TensorPipe; every process stopped by
pid."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap

from conftest import listening_addresses, worker_pids
from hosts import FAR, far_group, stop, timed

from bench.netsetup import veth_pair
from rpcnb.procs.processes import pid_alive
from rpcnb.session import rendezvous

STRANGER = textwrap.dedent("""
    import json, os, socket, sys, time
    from concurrent.futures import ThreadPoolExecutor
    ports = json.loads(sys.argv[1])
    hello = bytes.fromhex("160301002a0100002603035f") + os.urandom(40)
    payloads = [os.urandom(64), bytes(64), b"\\xff" * 64,
                b"GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n", hello, b""]
    held = []
    def send(target):
        (addr, port), data = target
        s = socket.socket()
        s.settimeout(2.0)
        try:
            s.connect((addr, port))
        except OSError:
            s.close()
            return port, 0
        try:
            s.sendall(data)
        except OSError:
            pass
        if data:
            s.close()
        else:
            held.append(s)  # open half-way: never says anything
        return port, 1
    opened = {port: 0 for _, port in ports}
    with ThreadPoolExecutor(64) as pool:
        for port, n in pool.map(send, [(tuple(p), d) for p in ports for d in payloads]):
            opened[port] += n
    print(json.dumps(opened), flush=True)
    time.sleep(3)  # while the group works on
""")


def test_a_strangers_bytes_end_no_member(kernel, netns, tmp_path):
    tag = os.getpid() % 100000
    here = netns["addr"]
    with veth_pair(f"rpcnb-x{tag}", f"rpx{tag}", f"10.214.{tag % 250}") as third:
        subprocess.run(["ip", "netns", "exec", third["ns"], "ip", "route", "add",
                        here.rsplit(".", 1)[0] + ".0/30", "via", third["addr"]], check=True)
        procs, _ = far_group(kernel, netns, tmp_path)
        try:
            pids = worker_pids(kernel)
            store_port = int(kernel.value("_s.init_method").rsplit(":", 1)[1])
            ports = sorted({(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1]))
                            for name in ("worker0", "worker1")
                            for a in listening_addresses(pids[name])
                            if a.startswith(here + ":")})
            tensorpipe = [p for _, p in ports if p != store_port]
            assert len(tensorpipe) >= 2 * 17, ports  # 1 + 16 lanes each

            # the group works while the stranger scans and sends
            stranger = subprocess.Popen(
                ["ip", "netns", "exec", third["ns"], sys.executable, "-c", STRANGER,
                 json.dumps(ports)], stdout=subprocess.PIPE, text=True)
            try:
                opened = {int(k): v for k, v in json.loads(stranger.stdout.readline()).items()}
                out, took = timed(kernel, "%%remote --all --fetch\n6 * 7")
                assert ast.literal_eval(out.text) == {n: 42 for n in ("worker1", *FAR)}, out
                stranger.wait(30)
            finally:
                if stranger.poll() is None:
                    stranger.kill()
                    stranger.wait(5)

            # no TensorPipe port let the stranger open a connection; the store's did (a
            # joiner comes from a host nobody knows yet) and it still serves
            assert opened[store_port] > 0, opened
            assert not any(opened[p] for p in tensorpipe), opened
            for name, pid in pids.items():
                assert pid_alive(pid), f"{name} (pid {pid}) ended"
            out, took = timed(kernel, "%%remote --all --fetch\nimport os\nos.getpid()")
            assert not out.error, out
            assert took < 5, took
            store = rendezvous.open_store(kernel.value("_s.init_method"))
            assert store.get("rpcnb/leader") == b"worker0"  # the store serves on
            kernel.execute("import rpcnb")
            assert kernel.value("rpcnb.run('worker2', '6 * 7', fetch=True)") == 42
            print(f"the stranger opened {sum(opened.values())} connections, all to the store; "
                  f"{len(tensorpipe)} TensorPipe ports filtered")
        finally:
            stop(procs, netns["ns"])
    assert set(FAR) <= set(pids)
