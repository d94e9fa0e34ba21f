"""The `rpcnb` kernelspec: kernels, and the workers they start, in a private network
namespace of the user (rpcnb.sandbox.netns), reached by Jupyter over ipc sockets (rpcnb.sandbox.provisioner);
another user of the machine finds none of their ports. Real kernels, real workers, a real
outsider (user `nobody`); every process a test starts is stopped by pid at its end."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import pwd
import re
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import Kernel, Seen, worker_pids

from rpcnb.procs.processes import descendants, kill_all, pid_alive
from rpcnb.sandbox import isolation
from rpcnb.sandbox.netns import PIDFILE, find_holder
from rpcnb.sandbox.provisioner import NAME as PROVISIONER

HERE = Path(__file__).parents[1]  # tests/: the helpers beside conftest.py
JUPYTER = Path(sys.executable).parent / "jupyter"


def net_ns(pid: int | str = "self") -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def listeners(pid: int) -> dict[int, int]:
    """{socket inode: port} of the TCP sockets ``pid`` listens on, read in its own namespace."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return {inode: port for _, port, inode in tcp_table(f"/proc/{pid}/net") if inode in inodes}


def tcp_table(net: str = "/proc/net") -> list[tuple[str, int, int]]:
    """(local address in hex, port, inode) of every listening TCP socket in a namespace."""
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(net, table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                addr, port = fields[1].split(":")
                found.append((addr, int(port, 16), int(fields[9])))
    return found


def group_listeners(k: Kernel) -> dict[int, int]:
    found: dict[int, int] = {}
    for pid in worker_pids(k).values():
        found.update(listeners(pid))
    return found


def main_port(k: Kernel, name: str) -> int:
    """The port ``name``'s TensorPipe agent accepts pipes on, as the group's store says
    (the test may read the 0700 group directory; the outsider cannot)."""
    store = k.value("__import__('rpcnb.session.state').session.state.current().init_method").removeprefix("file://")
    pattern = rb"addrs/" + name.encode() + rb".{1,8}?uv://127\.0\.0\.1:(\d+)"
    found = re.search(pattern, Path(store).read_bytes(), re.S)
    assert found, f"no address of {name} in {store}"
    return int(found.group(1))


def fetch(k: Kernel, worker: str, code: str):
    """The value of ``code``'s last expression on ``worker`` (``%%remote --fetch``)."""
    return ast.literal_eval(k.execute(f"%%remote {worker} --fetch\n{code}").text)


STATUS = "import rpcnb.sandbox.isolation as i\n(i.status().isolated, i.status().why)"


@pytest.fixture
def runtime():
    """A runtime directory of its own (so its own namespace holder); the holder is stopped
    at the end."""
    path = Path(tempfile.mkdtemp(prefix="rpcnb-rt-"))
    try:
        yield path
    finally:
        holder = find_holder(path)
        if holder is not None:
            os.kill(holder.pid, signal.SIGKILL)
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def rpcnb_kernel(kernel_factory, runtime):
    def make() -> Kernel:
        return kernel_factory("rpcnb", {isolation.RUNTIME_ENV: str(runtime)})
    return make


def test_the_kernelspec_is_installed():
    listed = json.loads(subprocess.run([str(JUPYTER), "kernelspec", "list", "--json"], check=True,
                                       capture_output=True, text=True, timeout=60).stdout)
    spec = listed["kernelspecs"]["rpcnb"]["spec"]
    assert spec["display_name"] == isolation.DISPLAY_NAME
    assert spec["argv"][0] == "python" and spec["argv"][2:4] == ["rpcnb.netns", "run"]
    assert spec["metadata"]["kernel_provisioner"]["provisioner_name"] == PROVISIONER
    found = importlib.metadata.entry_points(group="jupyter_client.kernel_provisioners")
    assert [e.value for e in found if e.name == PROVISIONER] == [
        "rpcnb.sandbox.provisioner:IsolatedProvisioner"]


def test_a_group_runs_in_a_private_namespace_reached_over_ipc(rpcnb_kernel, runtime):
    k = rpcnb_kernel()
    conn = json.loads(Path(k.km.connection_file).read_text())
    assert conn["transport"] == "ipc" and conn["kernel_name"] == "rpcnb"
    sockets = Path(conn["ip"]).parent
    info = sockets.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    assert sockets.parent == runtime

    k.execute("%load_ext rpcnb")
    k.execute("%rpc_init --workers 2")
    pid, ns, answer = fetch(k, "worker1", "import os\n(os.getpid(), os.readlink('/proc/self/ns/net'), 6 * 7)")
    assert answer == 42
    pids = worker_pids(k)
    assert pid == pids["worker1"]
    holder = find_holder(runtime)
    assert holder is not None
    assert {net_ns(p) for p in pids.values()} == {ns} == {holder.net}
    assert ns != net_ns()

    inside = group_listeners(k)
    assert len(inside) >= 3 * 17  # each member: TensorPipe's main port and 16 lanes
    host = {inode for _, _, inode in tcp_table()}
    assert not host & set(inside), "the group's listeners are visible from the host"
    ss = subprocess.run(["ss", "-ltnHe"], capture_output=True, text=True, timeout=10).stdout
    assert not {int(i) for i in re.findall(r"ino:(\d+)", ss)} & set(inside)

    isolated = (True, isolation.ISOLATED.format(net=ns))
    assert fetch(k, "worker0", STATUS) == fetch(k, "worker2", STATUS) == isolated
    k.execute("%rpc_shutdown")


def test_two_rpcnb_kernels_share_the_namespace_and_join(rpcnb_kernel):
    first = rpcnb_kernel()
    first.execute("%load_ext rpcnb")
    out = first.execute("%rpc_init --workers 1")
    join_line = next(ln.strip() for ln in out.stdout.splitlines()
                     if ln.strip().startswith("%rpc_init --join")).replace("NAME", "alice")
    second = rpcnb_kernel()
    assert net_ns(first.pid) == net_ns(second.pid) != net_ns()
    second.execute("%load_ext rpcnb")
    second.execute("here = 'alice'")
    second.execute(join_line)
    across = first.execute("%%remote alice --fetch\nimport os\n(here, os.getpid())")
    assert across.text == repr(("alice", second.pid))
    assert second.execute("%%remote worker1 --fetch\n40 + 2").text == "42"
    first.execute("%rpc_shutdown")


def test_a_kept_group_stays_in_the_namespace_across_a_restart(rpcnb_kernel, runtime):
    # the keeper and its workers live in the user's namespace, not the kernel's process
    # tree: the kernel restarted (a new kernel process, the same namespace) attaches, and
    # nothing of the group is visible from the host
    k = rpcnb_kernel()
    k.execute("%load_ext rpcnb")
    k.execute("%rpc_init --workers 1 --keep 10m")
    k.execute("%%remote worker1\nw = 42")
    rec = json.loads((runtime / "kept" / "group1" / "record.json").read_text())
    pids = [rec["pid"], *rec["workers"].values()]
    seen = Seen(pids)
    try:
        holder = find_holder(runtime)
        assert holder is not None and {net_ns(p) for p in pids} == {holder.net} != {net_ns()}
        k.km.restart_kernel(now=False)
        k.kc.wait_for_ready(timeout=60)
        k.pid = k.km.provisioner.pid
        k.known.add(k.pid)
        assert all(pid_alive(p) for p in pids)
        k.execute("%load_ext rpcnb")
        assert "attached to kept group group1" in k.execute("%rpc_init --attach").stdout
        assert fetch(k, "worker1", "w") == 42
        assert fetch(k, "worker1", STATUS) == (True, isolation.ISOLATED.format(net=holder.net))
        inside: dict[int, int] = {}
        for pid in pids:
            inside.update(listeners(pid))
        assert inside and not {inode for _, _, inode in tcp_table()} & set(inside)
        k.execute("%rpc_shutdown")
        assert not [p for p in pids if wait_gone(p)]
    finally:
        seen.kill()


def wait_gone(pid: int, timeout: float = 15) -> bool:
    """Whether ``pid`` is still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pid_alive(pid)


def test_a_gone_holder_is_replaced(rpcnb_kernel, runtime):
    first = rpcnb_kernel()
    old = find_holder(runtime)
    assert old is not None
    os.kill(old.pid, signal.SIGKILL)
    second = rpcnb_kernel()
    new = find_holder(runtime)
    assert new is not None and new.pid != old.pid
    assert net_ns(second.pid) == new.net != net_ns(first.pid) == old.net
    assert first.value("1 + 1") == 2  # the first kernel keeps its namespace


def python_for(user: str) -> list[str]:
    """An interpreter ``user`` can run that finds this venv's torch: the venv's own, else
    the system's Python of the same version with the venv's site-packages on its path."""
    site = next(p for p in sys.path if p.endswith("site-packages"))
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = [[sys.executable], ["env", f"PYTHONPATH={site}", f"/usr/bin/{version}"]]
    for cmd in candidates:
        check = subprocess.run(["runuser", "-u", user, "--", *cmd, "-c",
                                "import importlib.util as u; assert u.find_spec('torch')"],
                               capture_output=True, timeout=30, cwd="/")
        if check.returncode == 0:
            return cmd
    pytest.skip(f"user {user} can run no Python that imports torch from {site} "
                f"(the venv's interpreter lives under a private home)")


def attack(ports: list[int], ipc: list[str], marker: Path) -> dict:
    """Run tests/outsider.py as user `nobody` against ``ports`` and return its report."""
    if os.geteuid() != 0 or not shutil.which("runuser"):
        pytest.skip("running the outsider as user nobody needs root and runuser")
    nobody = pwd.getpwnam("nobody")
    python = python_for("nobody")
    for tries_left in (1, 0):
        work = Path(tempfile.mkdtemp(prefix="rpcnb-eve-"))
        os.chown(work, nobody.pw_uid, nobody.pw_gid)
        try:
            proc = subprocess.run(
                ["runuser", "-u", "nobody", "--", *python, str(HERE / "outsider.py"),
                 "--ports", ",".join(map(str, ports)), "--ipc", ",".join(ipc),
                 # its calls' limit: a refused connect fails at once, a starved
                 # outsider (two busy cores) must not take a slow one for an answer
                 "--marker", str(marker), "--work", str(work), "--timeout", "10"],
                capture_output=True, text=True, timeout=120, cwd=work,
                env={"HOME": str(work), "PATH": os.environ["PATH"],
                     "TORCH_CPP_LOG_LEVEL": "ERROR"},
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)
        # A TCP self-connect: the group's port numbers are free on the host (its listeners
        # are in another network namespace), so a connect whose ephemeral source port is
        # the target port connects to itself, and the outsider's TensorPipe aborts on its
        # own handshake read back ("Unexpected Encoding Type"). It reached nothing of the
        # group; the next try takes other source ports.
        if proc.returncode != 0 and "Unexpected Encoding Type" in proc.stderr and tries_left:
            continue
        break
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["uid"] == nobody.pw_uid
    return report


@pytest.fixture
def marker():
    path = Path(tempfile.gettempdir()) / f"rpcnb-pwned-{os.getpid()}-{time.monotonic_ns()}"
    yield path
    path.unlink(missing_ok=True)


class Decoys:
    """Listeners of the test's own on the host's 127.0.0.1 at the port numbers of an isolated
    group (free on the host: the group listens in its own namespace). While they listen, no
    other process on this shared machine (a parallel test's group) can come to listen
    there, so the outsider's junk reaches nobody's TensorPipe (it would abort it); what
    arrives is counted: the host's socket at that number got it, not the group's."""

    def __init__(self, ports: list[int]):
        self.socks: dict[int, socket.socket] = {}
        for port in ports:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))  # no SO_REUSEADDR: nobody shares it meanwhile
                s.listen(64)
            except OSError:  # something on the host has it: not one to try
                s.close()
                continue
            s.setblocking(False)
            self.socks[port] = s
        self.hits = dict.fromkeys(self.socks, 0)
        self.inodes = {os.fstat(s.fileno()).st_ino for s in self.socks.values()}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        for port, s in self.socks.items():
            sel.register(s, selectors.EVENT_READ, port)
        while not self.stop.is_set():
            for key, _ in sel.select(0.1):
                try:
                    conn, _ = key.fileobj.accept()
                except OSError:
                    continue
                self.hits[key.data] += 1
                conn.close()  # what it sent is junk; the outsider sees the end

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for s in self.socks.values():
            s.close()


def test_an_outsider_reaches_nothing_of_an_isolated_group(rpcnb_kernel, marker):
    k = rpcnb_kernel()
    k.execute("%load_ext rpcnb")
    for _ in range(5):
        k.execute("%rpc_init --workers 2")
        pids = worker_pids(k)
        inside = group_listeners(k)
        target = main_port(k, "worker1")
        assert target in inside.values()
        # the group's very port numbers, held on the host by decoys, minus those something
        # outside the group listens on (this machine is shared: the outsider must not hit
        # anyone else, now or while it runs)
        decoys = Decoys(sorted(set(inside.values())))
        if target in decoys.socks:
            break
        # worker1's port number is also in use on the host (the namespace has ports of its
        # own: a parallel test's process took the same number there): a group anew
        decoys.close()
        k.execute("%rpc_shutdown")
    assert target in decoys.socks, "worker1's port was taken on the host by something else 5 times"
    ports = sorted(decoys.socks)
    conn = json.loads(Path(k.km.connection_file).read_text())
    ipc = [f"{conn['ip']}-{conn[key]}" for key in ("shell_port", "control_port", "hb_port")]
    try:
        report = attack(ports, ipc, marker)
    finally:
        decoys.close()

    seen = {inode for _, _, inode in report["listening"]}
    assert decoys.inodes <= seen, "the outsider's listing works: it sees the host's listeners"
    assert not seen & set(inside), "the outsider sees none of the group's listeners"
    # every connection to the group's port numbers landed on the host's socket there
    assert set(report["connect"]) == {str(p) for p in ports}, report["connect"]
    assert all(r == "connected" for r in report["connect"].values()), report["connect"]
    assert all(decoys.hits[p] >= 3 for p in ports), decoys.hits  # a connect, junk twice
    assert not any(r == "ran" for r in report["rpc"].values()), report["rpc"]
    assert all(r.startswith("PermissionError") for r in report["ipc"].values()), report["ipc"]
    assert not marker.exists(), "the outsider ran code in the group"
    assert all(pid_alive(p) for p in pids.values())
    assert group_listeners(k) == inside  # every listener still there, none poisoned
    assert k.execute("%%remote --all --fetch\n6 * 7").text
    assert k.execute("%%remote worker1 --fetch\n6 * 7").text == "42"
    k.execute("%rpc_shutdown")


def test_a_plain_kernel_says_it_is_exposed_and_refuses_unsigned_calls(kernel, marker):
    """Against a plain kernel's group the outsider finds the ports; its Python route is
    refused by the signature check (rpcnb.paths.serialize), and %rpc_init said the ports are
    open to every user of the machine."""
    kernel.execute("%load_ext rpcnb")
    out = kernel.execute("%rpc_init --workers 1")
    assert "this group's ports are open to every user of this machine" in out.stdout
    assert "start the notebook on 'Python 3 (rpcnb)'" in out.stdout
    assert "open to every user" not in kernel.execute("%rpc_shutdown\n%rpc_init --workers 1"
                                                        ).stdout  # said once per kernel
    assert fetch(kernel, "worker0", STATUS) == (False, isolation.NOT_RPCNB_KERNEL.format(name="python3"))
    target = main_port(kernel, "worker1")
    assert target in {port for _, port, _ in tcp_table()}  # plainly visible
    report = attack([target], [], marker)
    assert "not signed with the group's secret" in report["rpc"][str(target)], report["rpc"]
    assert not marker.exists()


def test_a_plain_kernel_cannot_join_an_isolated_group(rpcnb_kernel, kernel):
    # they live in different network namespaces: the joiner could never reach the
    # members, and torch would wait a minute to say so; rpcnb says it at once
    first = rpcnb_kernel()
    first.execute("%load_ext rpcnb")
    out = first.execute("%rpc_init --workers 1")
    join_line = next(ln.strip() for ln in out.stdout.splitlines()
                     if ln.strip().startswith("%rpc_init --join")).replace("NAME", "bob")
    kernel.execute("%load_ext rpcnb")
    t0 = time.monotonic()
    refused = kernel.execute(join_line, allow_error=True)
    assert time.monotonic() - t0 < 15  # torch alone: a minute (its import is most of this)
    assert "runs in another network namespace" in refused.traceback
    assert "bob" not in first.execute("%rpc_workers").text
    first.execute("%rpc_shutdown")


# A front end in a user namespace of its own whose user.max_user_namespaces is 0 (set
# there, so the machine's own setting stays as it is; that one needs CAP_SYS_RESOURCE):
# from inside, creating a user namespace fails as on a machine that forbids them.
DISABLED = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from conftest import Kernel
k = Kernel("rpcnb", {"RPCNB_RUNTIME_DIR": sys.argv[2]})
try:
    code = ("import os, rpcnb.sandbox.isolation as i\n"
            "(i.status().isolated, i.status().why, os.readlink('/proc/self/ns/net'))")
    k.execute("%load_ext rpcnb")
    k.execute("%rpc_init --workers 1")
    found = [k.execute(f"%%remote {w} --fetch\n{code}").text for w in ("worker0", "worker1")]
    k.execute("%rpc_shutdown")
    print(json.dumps({"pid": k.pid, "connection": k.km.connection_file, "found": found}))
finally:
    k.close()
"""


def test_the_kernel_starts_plain_where_user_namespaces_are_disabled(runtime):
    if not shutil.which("unshare"):
        pytest.skip("needs unshare(1) to start the front end in a user namespace of its own")
    limited = ["unshare", "--user", "--map-root-user", "--", "sh", "-c",
               'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" "$@"']
    proc = subprocess.Popen([*limited, sys.executable, "-c", DISABLED, str(HERE), str(runtime)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        kill_all(descendants(proc.pid) + [proc.pid])
    if proc.returncode != 0 and "unshare failed" in err:
        pytest.skip(f"no user namespace for the front end here: {err.strip()}")
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out.splitlines()[-1])
    why = isolation.SYSCTL_DISABLED.format(what="user", setting="user.max_user_namespaces", value="0")
    statuses = [ast.literal_eval(text) for text in report["found"]]
    assert [(isolated, reason) for isolated, reason, _ in statuses] == [(False, why)] * 2
    assert statuses[0][2] == statuses[1][2] == net_ns()  # not in a namespace of their own
    assert not (runtime / PIDFILE).exists()  # no holder was left behind
