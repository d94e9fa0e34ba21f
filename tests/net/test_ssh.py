"""ipyparallel's SSH launcher, for real: an OpenSSH server of the test's own (its own
configuration, host key and authorized key, generated in a tmp dir) in the second network
namespace that tests/net/test_two_hosts.py uses, listening only on that namespace's veth
address. ``%rpc_init --engines 2 --launcher ssh`` logs in there with ssh (and copies the
engine's connection file with scp), the engines join the group across the veth, cells and
RRefs work on them, and ``%rpc_shutdown`` stops them (ipyparallel signals them over ssh).
sshd, its sessions and everything else stop by pid at the end, also on failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import worker_pids
from test_two_hosts import in_ns, ns_pids, tcp_sockets

from rpcnb.procs.processes import kill_all, pid_alive

SSHD = "/usr/sbin/sshd"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"  # scp of OpenSSH 9 speaks SFTP to the server
PORT = 2222  # inside the test's own namespace: nothing else listens there
HOST = "rpcnb-ssh-host"  # the name the cluster uses; the client configuration maps it


def _blocker() -> str | None:
    for tool in (SSHD, SFTP_SERVER):
        if not os.path.exists(tool):
            return f"{tool} is missing: make cluster-deps installs Debian's openssh-server (as root)"
    for tool in ("ssh", "scp", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is missing: apt-get install openssh-client"
    return None


def _addresses(netns: dict[str, str]) -> tuple[str, str]:
    here = subprocess.run(["ip", "-4", "-o", "addr", "show", netns["here"]],
                          capture_output=True, text=True).stdout.split()[3].split("/")[0]
    head, last = here.rsplit(".", 1)
    return here, f"{head}.{int(last) + 1}"


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rpcnb-test",
                    "-f", str(path)], check=True, capture_output=True)


@pytest.fixture
def sshd(netns, tmp_path):
    """sshd in the test namespace on ADDRESS:2222 only, keys and configuration in tmp_path;
    a client configuration that reaches it as ``rpcnb-ssh-host`` with the test's key."""
    why = _blocker()
    if why:
        pytest.skip(why)
    addr_a, addr_b = _addresses(netns)
    d = tmp_path / "ssh"
    d.mkdir(mode=0o700)
    _keygen(d / "host_key")
    _keygen(d / "client_key")
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    os.chmod(d / "authorized_keys", 0o600)
    user = os.environ.get("USER") or __import__("pwd").getpwuid(os.getuid()).pw_name
    server = d / "sshd_config"
    server.write_text("\n".join([
        f"ListenAddress {addr_b}:{PORT}",
        f"HostKey {d / 'host_key'}",
        f"AuthorizedKeysFile {d / 'authorized_keys'}",
        f"PidFile {d / 'sshd.pid'}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",  # tmp_path lies under /tmp, which everyone may write
        f"AllowUsers {user}",
        "X11Forwarding no",
        "AllowTcpForwarding no",
        f"Subsystem sftp {SFTP_SERVER}",
        "LogLevel VERBOSE",
        "",
    ]))
    known = d / "known_hosts"
    known.write_text(f"[{addr_b}]:{PORT} " + " ".join(
        (d / "host_key.pub").read_text().split()[:2]) + "\n")
    client = d / "ssh_config"
    client.write_text("\n".join([
        f"Host {HOST}",
        f"  HostName {addr_b}",
        f"  Port {PORT}",
        f"  User {user}",
        f"  IdentityFile {d / 'client_key'}",
        "  IdentitiesOnly yes",
        f"  UserKnownHostsFile {known}",
        "  StrictHostKeyChecking yes",  # the host key the test generated, nothing else
        "  BatchMode yes",
        "  ConnectTimeout 10",
        "",
    ]))
    check = subprocess.run([SSHD, "-t", "-f", str(server)], capture_output=True, text=True)
    made_run_dir = False
    if "privilege separation directory" in check.stderr and not os.path.exists("/run/sshd"):
        os.makedirs("/run/sshd", mode=0o755)  # what the ssh service's unit would create
        made_run_dir = True
        check = subprocess.run([SSHD, "-t", "-f", str(server)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    log = d / "sshd.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(in_ns(netns["ns"], SSHD, "-D", "-e", "-f", str(server)),
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not tcp_sockets({proc.pid}, netns["ns"], listening=True):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield {"ssh_config": client, "addr_a": addr_a, "addr_b": addr_b, "log": log,
               "pid": proc.pid, "user": user, "dir": d}
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        # sessions that outlived sshd (the engines' ssh sessions, ssh_waitpid)
        kill_all([p for p in ns_pids(netns["ns"]) if pid_alive(p)])
        if made_run_dir:
            shutil.rmtree("/run/sshd", ignore_errors=True)


def test_sshd_listens_only_on_the_test_address(sshd, netns):
    listening = tcp_sockets({sshd["pid"]}, netns["ns"], listening=True)
    assert {local for local, _, _ in listening} == {f"{sshd['addr_b']}:{PORT}"}
    out = subprocess.run(["ssh", "-F", str(sshd["ssh_config"]), HOST,
                          "readlink /proc/self/ns/net; echo $SSH_CONNECTION"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    their_ns, connection = out.stdout.splitlines()
    assert their_ns != os.readlink("/proc/self/ns/net")
    assert connection.split()[0] == sshd["addr_a"] and connection.split()[2:] == \
        [sshd["addr_b"], str(PORT)]
    # a key that is not in authorized_keys is refused
    stranger = sshd["dir"] / "stranger"
    _keygen(stranger)
    config = sshd["ssh_config"].read_text().replace(str(sshd["dir"] / "client_key"),
                                                     str(stranger))
    (sshd["dir"] / "stranger_config").write_text(config)
    out = subprocess.run(["ssh", "-F", str(sshd["dir"] / "stranger_config"), HOST, "true"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 255 and "Permission denied" in out.stderr, out.stderr


def test_ssh_launcher_engines_are_a_group(sshd, netns, kernel, tmp_path):
    addr_a, addr_b = sshd["addr_a"], sshd["addr_b"]
    ssh_args = f"['-F','{sshd['ssh_config']}']"
    cluster_args = " ".join([
        f"profile_dir={tmp_path / 'profile'}",
        f"controller_ip={addr_a}",  # the engines reach the controller across the veth
        f"SSHEngineSetLauncher.engines={{'{HOST}':2}}",
        f"SSHEngineSetLauncher.ssh_args={ssh_args}",
        f"SSHEngineSetLauncher.scp_args={ssh_args}",
        f"SSHEngineSetLauncher.remote_python={sys.executable}",
        # the other host's own profile directory (this one would be copied onto itself)
        f"SSHEngineSetLauncher.remote_profile_dir={tmp_path / 'remote-profile'}",
        # ipyparallel's own 60 s for the engines to register: on two cores that make test
        # keeps busy, an engine started over ssh has taken longer (how fast is not the test)
        "engine_timeout=180",
    ])
    kernel.execute("%load_ext rpcnb")
    out = kernel.execute(f"%rpc_init --engines 2 --launcher ssh --port 0 --host {addr_a} "
                         f"--allow-remote --cluster-args \"{cluster_args}\"", timeout=240)
    assert out.stdout.count(" engine ") == 2, out.stdout + out.stderr
    members = worker_pids(kernel)
    engines = [members["worker1"], members["worker2"]]
    there = set(ns_pids(netns["ns"]))
    assert set(engines) <= there, (engines, there)
    assert f"Accepted publickey for {sshd['user']} from {addr_a}" in sshd["log"].read_text()

    # the engines were started by a login over ssh, on the other host's address
    seen = kernel.execute("%%remote --all --fetch\nimport os\nos.environ.get('SSH_CONNECTION')").text
    assert seen.count(f"{addr_a} ") == 2 and seen.count(f"{addr_b} {PORT}") == 2, seen
    table = kernel.execute("%rpc_workers").text
    rows = {line.split()[0]: line for line in table.splitlines() if line.startswith("worker")}
    for name in ("worker1", "worker2"):
        assert f"{addr_b} ({netns['there']})" in rows[name] and " engine " in rows[name], table

    # an RRef round trip and a tensor across, %%remote in the engine's namespace (%%px's)
    kernel.execute("%%remote worker1 -o r\nimport torch\ntorch.arange(3.) + 1")
    assert kernel.value("r.to_here().tolist()") == [1.0, 2.0, 3.0]
    kernel.execute("import torch\nx = torch.ones(50_000)")
    kernel.execute("%%remote worker2 --push x\ny = x * 3")
    kernel.execute("import rpcnb.integrations.ipyparallel\nrc = rpcnb.integrations.ipyparallel.client()")
    assert kernel.value("float(rc[1].pull('y', block=True).sum())") == 150000.0
    got = kernel.execute("%%remote worker2 --fetch\nimport torch, torch.distributed.rpc as rpc\n"
                         "float(rpc.rpc_sync('worker1', torch.add, args=(y, 1)).sum())").text
    assert float(got) == 200000.0

    # %rpc_shutdown stops the cluster it started: ipyparallel kills the engines over ssh
    kernel.execute("%rpc_shutdown", timeout=120)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(pid_alive(p) for p in engines):
        time.sleep(0.3)
    assert not any(pid_alive(p) for p in engines), engines
    assert pid_alive(sshd["pid"])  # the test's sshd: stopped by the fixture, not by rpcnb
