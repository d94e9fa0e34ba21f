"""Trust: loopback by default, the group secret, authenticated joins, TCP rendezvous."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import children_of, listening_addresses, worker_pids

from rpcnb.session import rendezvous

OUTSIDER = Path(__file__).parents[1] / "outsider.py"


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
        "import torch.distributed.rpc as rpc, rpcnb.session.protocol as p\n"
        "try:\n    rpc.rpc_sync('worker1', p.entry, args=('forged', 'run_cell', ('c1', "
        "'worker0', 'import os', False, {})))\nexcept Exception as e:\n    print('refused' if "
        "'did not carry the group' in str(e) else repr(e))"
    )
    assert out.stdout.strip() == "refused"
    assert group.execute("%%remote worker1 --fetch\n'still serving'").text == "'still serving'"


def test_every_request_is_refused_without_the_token(group):
    # every operation another member may ask for, called as an outsider would: a forged
    # token, no token, a token of another type; nothing runs and the worker serves on
    out = group.execute(
        "import torch.distributed.rpc as rpc\n"
        "from rpcnb.session import protocol, state\nfrom rpcnb.membership import handlers\n"
        "refused = {}\n"
        "for op in handlers.OPERATIONS:\n"
        "    for token in ('forged', None, 0):\n"
        "        try:\n"
        "            rpc.rpc_sync('worker1', protocol.entry, args=(token, op, ()), timeout=10)\n"
        "            refused[op] = 'ran'\n"
        "        except Exception as e:\n"
        "            if 'did not carry the group' not in str(e):\n"
        "                refused[op] = repr(e)[:200]\n"
        "print(sorted(handlers.OPERATIONS))\n"
        "print(refused)\n"
        "print(protocol.call(state.current().token, 'worker1', 'probe_echo'))"
    , timeout=180)
    ops, refused, ok = out.stdout.strip().splitlines()
    assert len(eval(ops)) >= 15
    assert refused == "{}"
    assert ok == "None"  # with the token, the same request is answered
    assert group.execute("%%remote worker1 --fetch\n'still serving'").text == "'still serving'"


def test_an_outsider_at_a_members_port_cannot_make_it_unpickle(group, tmp_path):
    # the route an outsider takes (tests/outsider.py): its own agent, told that a member
    # is at worker1's TensorPipe port, then plain torch RPC with a Python function. Without
    # the group's secret its pickle is not signed, so worker1 refuses it before unpickling.
    # (As another user, and against an isolated kernel: tests/net/test_isolation.py.)
    port = int(group.value("__import__('torch').distributed.rpc.api._get_current_rpc_agent()"
                           ".store.get('addrs/worker1').decode()").rsplit(":", 1)[1])
    marker = tmp_path / "ran"
    proc = subprocess.run([sys.executable, str(OUTSIDER), "--ports", str(port), "--marker",
                           str(marker), "--work", str(tmp_path), "--only-rpc"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)["rpc"][str(port)]
    assert "not signed with the group's secret" in result, result
    assert not marker.exists()
    assert group.execute("%%remote worker1 --fetch\n'still serving'").text == "'still serving'"


@pytest.mark.serial  # a refusal is timed (within 5 s)
def test_wrong_secret_or_version_is_refused_before_joining(own_group, kernel_factory):
    group = own_group  # bob joins it: the shared kernel, lent, with a group of its own
    path = join_file(group)
    conn = json.loads(open(path).read())
    eve = kernel_factory()
    eve.execute("%load_ext rpcnb")
    t0 = time.monotonic()
    out = eve.execute(f"%rpc_init --join {conn['address']} --token {'0' * 32} --name eve",
                      allow_error=True)
    assert time.monotonic() - t0 < 5
    assert "is not that group's" in out.traceback
    # another protocol (an older or newer rpcnb) is refused the same way
    out = eve.execute("import rpcnb.session.rendezvous as r\nr.PROTOCOL = '0'\n"
                      f"%rpc_init --join {path} --name eve2", allow_error=True)
    assert f"speaks rpcnb protocol {rendezvous.PROTOCOL} and this kernel speaks 0" in out.traceback
    assert eve.value("__import__('rpcnb.session.state').session.state.is_initialized()") is False
    # neither took torch's membership token: a correct join goes straight through
    ok = kernel_factory()
    ok.execute("%load_ext rpcnb")
    t0 = time.monotonic()
    ok.execute(f"%rpc_init --join {path} --name bob")
    assert time.monotonic() - t0 < 15
    assert "eve" not in group.execute("%rpc_workers").text
    assert group.execute("%%remote bob --fetch\n6 * 7").text == "42"


def test_tcp_group_on_loopback_with_token_join_and_refusal(rpcnb_kernel, kernel_factory):
    leader = rpcnb_kernel
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
    assert "is not that group's" in wrong.traceback
    assert eve.value("__import__('rpcnb.api').api.is_initialized()") is False
    table = leader.execute("%rpc_workers").text
    assert "eve" not in table and "alice" in table
    bad = leader.execute("%%remote eve\n1", allow_error=True)
    assert "There is no worker 'eve'" in bad.traceback
    assert alice.execute("%%remote worker1 --fetch\n2 * 21").text == "42"
    t0 = time.monotonic()
    leader.execute("%rpc_shutdown")
    assert time.monotonic() - t0 < 15


def test_busy_port_and_unreachable_rendezvous(rpcnb_kernel):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        before = set(children_of(rpcnb_kernel.pid))
        out = rpcnb_kernel.execute(f"%rpc_init --workers 1 --port {port}", allow_error=True)
        assert f"Port {port} on 127.0.0.1 is busy" in out.traceback
        assert set(children_of(rpcnb_kernel.pid)) == before
    finally:
        taken.close()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    free_port = closed.getsockname()[1]
    closed.close()
    t0 = time.monotonic()
    out = rpcnb_kernel.execute(f"%rpc_init --join tcp://127.0.0.1:{free_port} --token abc --name bob",
                         allow_error=True)
    assert time.monotonic() - t0 < 15
    assert "No rpcnb group answers at" in out.traceback
    assert rpcnb_kernel.value("__import__('rpcnb.api').api.is_initialized()") is False


def test_non_loopback_host_needs_allow_remote(rpcnb_kernel):
    out = rpcnb_kernel.execute("%rpc_init --workers 1 --port 0 --host 0.0.0.0", allow_error=True)
    assert "add --allow-remote" in out.traceback
    out = rpcnb_kernel.execute("%rpc_init --workers 1 --host 127.0.0.1", allow_error=True)
    assert "--host goes with --port" in out.traceback


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


def test_a_group_on_another_interface_never_leaves_a_later_group_exposed(kernel, test_address):
    # TensorPipe listens where TP_SOCKET_IFNAME says, read once per process: after a group
    # on another interface the variable is put back and the store closed, and this kernel
    # refuses a loopback group (its TensorPipe would still listen on the other interface)
    iface, addr = test_address
    kernel.execute("%load_ext rpcnb")
    kernel.execute(f"%rpc_init --workers 1 --port 0 --host {addr} --allow-remote")
    assert kernel.value("__import__('os').environ['TP_SOCKET_IFNAME']") == iface
    kernel.execute("%rpc_shutdown")
    assert kernel.value("__import__('os').environ['TP_SOCKET_IFNAME']") == "lo"
    assert not any(a.startswith(addr) for a in listening_addresses(kernel.pid))
    before = set(children_of(kernel.pid))
    out = kernel.execute("%rpc_init --workers 1", allow_error=True)
    assert "restart the kernel first" in out.traceback and f"'{iface}'" in out.traceback
    assert set(children_of(kernel.pid)) == before
    kernel.km.restart_kernel(now=True)
    kernel.pid = kernel.km.provisioner.pid
    kernel.known.add(kernel.pid)
    kernel.kc.wait_for_ready(timeout=60)
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 1")
    for name, pid in worker_pids(kernel).items():
        for listened in listening_addresses(pid):
            assert listened.rsplit(":", 1)[0] in ("127.0.0.1", "::1"), (name, listened)
    kernel.execute("%rpc_shutdown")
