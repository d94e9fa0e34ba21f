"""Trust: loopback by default, the group secret, authenticated joins, TCP rendezvous."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time

import pytest
from conftest import children_of, listening_addresses, worker_pids


def join_file(k) -> str:
    line = next(ln.strip() for ln in k.execute("%rpc_workers").text.splitlines()
                if ln.strip().startswith("%rpc_init --join"))
    return line.split()[2]


def test_secret_stays_in_a_private_connection_file(group):
    path = join_file(group)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    secret = json.loads(open(path).read())["secret"]
    assert len(secret) >= 32
    # the secret never travels or lands in the (readable-by-peers) store
    store = open(os.path.join(os.path.dirname(path), "store"), "rb").read()
    assert secret.encode() not in store
    assert secret not in group.execute("%rpc_workers").text
    # and the workers did not get it on their command line
    for name, pid in worker_pids(group).items():
        if name != "worker0":
            assert secret not in open(f"/proc/{pid}/cmdline").read()


def test_rpcnb_requests_without_the_token_are_refused(group):
    out = group.execute(
        "import torch.distributed.rpc as rpc, rpcnb.worker as w\n"
        "try:\n    rpc.rpc_sync('worker1', w._run_cell, args=('forged', 'c1', 'worker0', "
        "'import os', False, {}))\nexcept Exception as e:\n    print('refused' if "
        "'did not carry the group' in str(e) else repr(e))"
    )
    assert out.stdout.strip() == "refused"
    assert group.execute("%%remote worker1 --fetch\n'still serving'").text == "'still serving'"


def test_tcp_group_on_loopback_with_token_join_and_refusal(kernel_factory):
    leader = kernel_factory()
    leader.execute("%load_ext rpcnb")
    out = leader.execute("%rpc_init --workers 1 --port 0")
    path = join_file(leader)
    conn = json.loads(open(path).read())
    assert conn["address"].startswith("tcp://127.0.0.1:")
    for name, pid in worker_pids(leader).items():
        for addr in listening_addresses(pid):
            assert addr.rsplit(":", 1)[0] in ("127.0.0.1", "::1"), (name, addr, out.stdout)
    # a kernel with the token joins from the tcp address
    alice = kernel_factory()
    alice.execute("%load_ext rpcnb\nmine = 'alice'")
    alice.execute(f"%rpc_init --join {conn['address']} --token {conn['secret']} --name alice")
    assert leader.execute("%%remote alice --fetch\nmine").text == "'alice'"
    # a kernel without the secret is refused, and never listed
    eve = kernel_factory()
    eve.execute("%load_ext rpcnb")
    no_token = eve.execute(f"%rpc_init --join {conn['address']} --name eve", allow_error=True)
    assert "needs the group's secret" in no_token.traceback
    wrong = eve.execute(f"%rpc_init --join {conn['address']} --token {'0' * 32} --name eve",
                        allow_error=True, timeout=60)
    assert "refused this kernel" in wrong.traceback
    assert eve.value("__import__('rpcnb.session').session.is_initialized()") is False
    table = leader.execute("%rpc_workers").text
    assert "eve" not in table and "alice" in table
    bad = leader.execute("%%remote eve\n1", allow_error=True)
    assert "There is no worker 'eve'" in bad.traceback
    assert alice.execute("%%remote worker1 --fetch\n2 * 21").text == "42"
    t0 = time.monotonic()
    leader.execute("%rpc_shutdown")
    assert time.monotonic() - t0 < 15


def test_busy_port_and_unreachable_rendezvous(kernel):
    kernel.execute("%load_ext rpcnb")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        before = set(children_of(kernel.pid))
        out = kernel.execute(f"%rpc_init --workers 1 --port {port}", allow_error=True)
        assert f"Port {port} on 127.0.0.1 is busy" in out.traceback
        assert set(children_of(kernel.pid)) == before
    finally:
        taken.close()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    free_port = closed.getsockname()[1]
    closed.close()
    t0 = time.monotonic()
    out = kernel.execute(f"%rpc_init --join tcp://127.0.0.1:{free_port} --token abc --name bob",
                         allow_error=True)
    assert time.monotonic() - t0 < 15
    assert "No rpcnb group answers at" in out.traceback
    assert kernel.value("__import__('rpcnb.session').session.is_initialized()") is False


def test_non_loopback_host_needs_allow_remote(kernel):
    kernel.execute("%load_ext rpcnb")
    out = kernel.execute("%rpc_init --workers 1 --port 0 --host 0.0.0.0", allow_error=True)
    assert "add --allow-remote" in out.traceback
    out = kernel.execute("%rpc_init --workers 1 --host 127.0.0.1", allow_error=True)
    assert "--host goes with --port" in out.traceback


@pytest.fixture
def test_address():
    """A veth interface of our own with a private test address (needs root, iproute2)."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("creating a test interface needs root and iproute2")
    name, addr = "rpcnbtest0", "10.213.77.1"
    made = subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name",
                           "rpcnbtest1"], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a dummy interface here: {made.stderr.decode().strip()}")
    try:
        subprocess.run(["ip", "addr", "add", f"{addr}/32", "dev", name], check=True)
        subprocess.run(["ip", "link", "set", name, "up"], check=True)
        subprocess.run(["ip", "link", "set", "rpcnbtest1", "up"], check=True)
        yield name, addr
    finally:
        subprocess.run(["ip", "link", "del", name], capture_output=True)


def test_allow_remote_listens_on_exactly_that_address(kernel, test_address):
    iface, addr = test_address
    kernel.execute("%load_ext rpcnb")
    out = kernel.execute(f"%rpc_init --workers 1 --port 0 --host {addr} --allow-remote")
    assert f"the group listens on {addr}" in out.stdout and "private network" in out.stdout
    assert "--token TOKEN" in out.stdout
    for name, pid in worker_pids(kernel).items():
        for listened in listening_addresses(pid):
            host = listened.rsplit(":", 1)[0]
            # the kernel's own ZMQ ports stay on loopback; rpcnb's sockets are on addr
            assert host in (addr, "127.0.0.1"), (name, listened)
            assert host != "0.0.0.0"
    assert any(a.startswith(addr) for a in listening_addresses(worker_pids(kernel)["worker1"]))
    assert kernel.execute("%%remote worker1 --fetch\n'over the test interface'").text \
        == "'over the test interface'"
    kernel.execute("%rpc_shutdown")
