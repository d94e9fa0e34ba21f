"""The opt-in UCX path (``--ucx``): values and dtypes, copy semantics, the missing extra,
a peer killed mid-transfer, nothing left after shutdown. Real workers, real UCX (ucxx is
in the test extra); CPU tensors here, CUDA ones marked ``gpu``.

The test process itself is worker0 in most tests (the Python API).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed.rpc as rpc
from conftest import (
    Seen,
    children_of,
    kill_all,
    listening_addresses,
    pid_alive,
    run_watched,
    started_here,
    wait_until,
    worker_pids,
)

import rpcnb
from rpcnb import errors, machine
from rpcnb.paths import shm, ucx
from rpcnb.procs import launch
from rpcnb.session import state
from rpcnb.wire import options

# not imported here: rpcnb sets UCX's environment up before ucxx loads (its warnings off)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None,
    reason=f"the ucx extra is not installed: pip install -e '.[test,{options.ucx_extra()}]'")

MB = 1 << 20
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def echo(t):
    return t


def worker_ucx_stats():
    from rpcnb.paths import ucx as u

    return u.stats()


def add_one_in_place(t):
    t.add_(1)
    return t.sum().item()


# conftest.api_group: two workers on this host with UCX, rpcnb's shared memory off (on,
# it carries CPU tensors on one host: test_on_one_host_cpu_tensors_keep_rpcnbs_shared_memory)
API_WORKERS = 2
API_INIT = {"ucx": True, "shm": False}


@pytest.fixture
def ucx_group(api_group):
    return api_group


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int64, torch.bool, torch.complex64]


def test_values_and_dtypes_arrive_equal_over_ucx(ucx_group):
    before = ucx.stats()
    for dtype in DTYPES:
        x = (torch.rand(3 * MB // 4, 4) * 100).to(dtype)
        back = rpc.rpc_sync("worker1", echo, args=(x,))  # an argument out, a result back
        assert back.dtype == dtype and back.shape == x.shape and torch.equal(back, x), dtype
    odd = torch.arange(4 * MB, dtype=torch.float32).view(2048, 2048).t()  # not contiguous
    assert torch.equal(rpc.rpc_sync("worker2", echo, args=(odd,)), odd)
    after = ucx.stats()
    assert after["sent"] - before["sent"] == len(DTYPES) + 1
    assert after["received"] - before["received"] == len(DTYPES) + 1
    assert set(after["transports"]) == {"worker1", "worker2"}
    small = torch.ones(16)
    assert torch.equal(rpc.rpc_sync("worker1", echo, args=(small,)), small)
    assert ucx.stats()["sent"] == after["sent"]  # below the threshold: TensorPipe


def test_push_fetch_and_remote_results_take_ucx_with_copy_semantics(ucx_group):
    big = torch.arange(2 * MB, dtype=torch.float32)
    before = ucx.stats()
    out = rpcnb.run("worker1", "big.add_(1)\nbig", push={"big": big}, fetch=True)
    assert torch.equal(out, torch.arange(2 * MB, dtype=torch.float32) + 1)
    assert torch.equal(big, torch.arange(2 * MB, dtype=torch.float32))  # ours untouched
    out.add_(5)  # and our copy is not theirs
    assert rpcnb.run("worker1", "big[0].item()", fetch=True) == 1.0
    r = rpcnb.run("worker2", "import torch\ntorch.full((3 * 2**20,), 2.0)")
    assert r.to_here().sum().item() == 6 * MB  # to_here() of rpcnb's result
    after = ucx.stats()
    assert after["sent"] == before["sent"] + 1  # the push
    assert after["received"] == before["received"] + 2  # the fetch and to_here()
    t = torch.zeros(2 * MB)
    assert rpc.rpc_sync("worker2", add_one_in_place, args=(t,)) == 2 * MB
    assert t.sum().item() == 0  # the callee changed its own copy
    assert rpc.rpc_sync("worker1", worker_ucx_stats)["sent"] >= 1
    assert not shm.stats()["in_flight"]


def test_received_buffers_are_reused_only_once_every_view_is_freed(own_api_group):
    def fetch(value: float) -> torch.Tensor:
        return rpcnb.run("worker1", f"import torch\ntorch.full((2**20,), {value})", fetch=True)

    a = fetch(1.0)
    before = ucx.stats()
    b = fetch(2.0)
    assert bool(a.eq(1).all()) and bool(b.eq(2).all())  # a is kept: b has a buffer of its own
    view = a[10:20]
    del a
    c = fetch(3.0)
    assert bool(view.eq(1).all()) and bool(c.eq(3).all())  # a view still holds a's buffer
    assert ucx.stats()["reused"] == before["reused"]
    del view
    d = fetch(4.0)
    assert ucx.stats()["reused"] == before["reused"] + 1  # now it is taken again
    assert bool(d.eq(4).all()) and bool(b.eq(2).all()) and bool(c.eq(3).all())
    assert ucx.stats()["pool_bytes"] >= 3 * 4 * MB
    link = ucx.link()  # the group's UCX: its receive pool outlives the group while used
    rpcnb.shutdown()
    assert bool(d.eq(4).all())  # still mapped: the group ended, d did not
    assert link is not None and link.stats()["pool_bytes"] >= 4 * MB  # b, c, d until freed
    del b, c, d
    assert link.stats()["pool_bytes"] == 0


def test_telemetry_names_the_ucx_transport(ucx_group):
    from rpcnb import telemetry
    from rpcnb.observe import channels

    rpc.rpc_sync("worker1", echo, args=(torch.ones(2 * MB),))
    stats = telemetry.peer_stats()["worker1"]
    assert stats["ucx"] == f"ucx: {ucx.transports()['worker1']}"
    assert stats["ucx"] in ("ucx: cma", "ucx: tcp", "ucx: posix", "ucx: sysv")
    paths = channels.ucx_paths()
    assert ("worker0", "worker1") in paths and ("worker1", "worker0") in paths
    assert "worker1 -> worker0: ucx: " in channels.describe_ucx(paths)
    # UCX's TCP transport listens on loopback only, like the rest of a one-host group
    procs = state.current().procs
    for pid in (os.getpid(), procs["worker1"].pid, procs["worker2"].pid):
        for listened in listening_addresses(pid):
            host = listened.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")
            assert host in ("127.0.0.1", "::1"), (pid, listened)


def test_on_one_host_cpu_tensors_keep_rpcnbs_shared_memory(kernel):
    """``--ucx`` never makes a one-host transfer slower: a CPU tensor keeps rpcnb's
    shared memory there (faster than UCX's CMA, bench.ucx), UCX carries the rest."""
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 1 --ucx")
    kernel.execute("import torch\nbig = torch.ones(2**21)")
    kernel.execute("%%remote worker1 --push big --fetch -o back\nbig * 3")
    assert kernel.value("float(back.sum())") == 3.0 * 2 * MB
    assert kernel.value("__import__('rpcnb.paths.ucx').paths.ucx.stats()['received']") == 0
    assert kernel.value("__import__('rpcnb.paths.shm').paths.shm.stats()['sent']") >= 1
    kernel.execute("%rpc_shutdown")


def test_magics_take_ucx_and_channels_show_it(kernel):
    kernel.execute("%load_ext rpcnb")
    kernel.execute("%rpc_init --workers 1 --ucx --no-shm")
    kernel.execute("import torch\nbig = torch.ones(2**21)")
    kernel.execute("%%remote worker1 --push big --fetch -o back\nbig * 3")
    assert kernel.value("float(back.sum())") == 3.0 * 2 * MB
    assert kernel.value("__import__('rpcnb.paths.ucx').paths.ucx.stats()['sent']") == 1
    assert kernel.value("__import__('rpcnb.paths.ucx').paths.ucx.stats()['received']") == 1
    text = kernel.execute("%rpc_channels --text").stdout
    assert "worker0 -> worker1: ucx: " in text and "worker1 -> worker0: ucx: " in text
    log = kernel.value("open(__import__('rpcnb.session.state').session.state.current().procs['worker1']"
                       ".log_path).read()")
    assert "unused environment variable" not in log, log  # UCX's warnings stay quiet
    kernel.execute("%rpc_shutdown")


NO_FLAG = """
import sys, torch, rpcnb
import torch.distributed.rpc as rpc
rpcnb.init(1)
big = torch.ones(8 * 2**20)
assert rpcnb.run("worker1", "big.sum().item()", push={"big": big}, fetch=True) == big.numel()
there = rpcnb.run("worker1", "import sys\\n'ucxx' in sys.modules", fetch=True)
print("here", "ucxx" in sys.modules, "there", there, flush=True)
rpcnb.shutdown()
"""


def test_without_the_flag_nothing_imports_ucxx():
    env = {k: v for k, v in os.environ.items() if k != ucx.ENV}
    code, out, err, _ = run_watched([sys.executable, "-c", NO_FLAG], 120, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert code == 0, err[-2000:]
    assert "here False there False" in out


# ucxx hidden from this process, as if the extra were not installed (nothing else changes)
HIDDEN = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ucxx" or name.startswith("ucxx."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
import os, rpcnb
from rpcnb import errors
from rpcnb.wire import options
for how in ("flag", "env"):
    if how == "env":
        os.environ["RPCNB_UCX"] = "1"
    try:
        rpcnb.init(1, ucx=True) if how == "flag" else rpcnb.init(1)
    except errors.RpcnbError as exc:
        assert str(exc) == errors.UCX_MISSING.format(extra=options.ucx_extra()), exc
        started = __import__("rpcnb.session.state").session.state.is_initialized()
        launch = __import__("rpcnb.procs.launch").procs.launch
        processes = __import__("rpcnb.procs.processes").procs.processes
        # rpcnb.init starts the workers' launcher as it is looked up (to overlap the
        # imports); a refused start stops it again, before it forked anything
        left = [p for p in processes.descendants(os.getpid()) if processes.pid_alive(p)]
        print(how, "refused", "initialized" if started or launch.current_launcher() or left
              else "nothing started", flush=True)
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
ip.run_line_magic("load_ext", "rpcnb")
from IPython.core.error import UsageError
try:
    ip.run_line_magic("rpc_init", "--workers 1 --ucx")
except UsageError as exc:
    print("magic:", exc, flush=True)
"""


def _watch_names(pid: int, seen: dict[int, str], procs: Seen, stop: threading.Event) -> None:
    """What each process below ``pid`` is (its name, its command line), while it runs;
    each noted in ``procs`` too (to be stopped by it)."""
    while not stop.is_set():
        for p in children_of(pid):
            if p not in seen:
                try:
                    procs.add(p)
                    name = Path(f"/proc/{p}/comm").read_text().strip()
                    cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    seen[p] = f"{name} | {cmd}"
                except OSError:
                    pass
        stop.wait(0.01)


def test_the_missing_extra_says_how_to_install_it():
    names: dict[int, str] = {}
    stop = threading.Event()
    seen = Seen()
    proc = subprocess.Popen([sys.executable, "-c", HIDDEN], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    watcher = threading.Thread(target=_watch_names, args=(proc.pid, names, seen, stop), daemon=True)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=120)
        code = proc.returncode
    finally:
        stop.set()
        watcher.join(5)
        seen.add(proc.pid)  # when it has not exited: else no process
        seen.kill()
    assert code == 0, err[-2000:]
    assert "flag refused nothing started" in out and "env refused nothing started" in out
    extra = options.ucx_extra()
    assert f"magic: {errors.UCX_MISSING.format(extra=extra)}" in out
    # the extra whose ucxx is built for this torch's CUDA (a CPU build takes the cu12 one)
    assert f"pip install 'rpcnb[{extra}]'" in out
    assert extra == ("ucx-cu13" if (torch.version.cuda or "").startswith("13.") else "ucx")
    # no worker was started (a forked worker names itself "rpcnb workerK"): only the
    # launchers the refused rpcnb.init lookups started, and their refusals stopped (the
    # magic refuses before it starts one); nothing is left
    assert not [n for n in names.values() if n.startswith("rpcnb worker")], names
    assert sum("forkserver" in n for n in names.values()) <= 2, names
    assert not [p for p in seen if pid_alive(p)]


def _kill_during(direction: str, nbytes: int) -> tuple[BaseException | None, float]:
    """Move ``nbytes`` between worker1 and here; SIGKILL worker1 while the tensor is on
    the wire. Returns the error the call raised and how long after the kill."""
    pid = state.current().procs["worker1"].pid
    box: dict[str, BaseException | None] = {"error": None}

    def move() -> None:
        try:
            if direction == "fetch":
                rpcnb.run("worker1", f"import torch\ntorch.ones({nbytes // 4})", fetch=True)
            else:
                rpcnb.run("worker1", "big.sum().item()", push={"big": torch.ones(nbytes // 4)},
                          fetch=True)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=move)
    t.start()
    busy = "receiving" if direction == "fetch" else "sending"
    assert wait_until(lambda: ucx.stats()[busy] > 0, 60, poll=0.0005)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    t.join(30)
    assert not t.is_alive()
    return box["error"], time.monotonic() - killed


@pytest.mark.parametrize("direction", ["fetch", "push"])
def test_a_peer_killed_mid_transfer_gives_the_died_error_within_5_s(ucx_group, direction):
    error, after = _kill_during(direction, 512 * MB)
    assert error is not None
    assert "'worker1' died" in str(error), error
    assert after < 5.0
    # the rest of the group keeps working, over UCX too
    back = rpc.rpc_sync("worker2", echo, args=(torch.ones(2 * MB),))
    assert back.sum().item() == 2 * MB


KERNEL_COPIES = """
import os, torch, rpcnb
from rpcnb.session import state
rpcnb.init(workers=1, ucx=True, shm=False)
print(os.getpid(), state.current().procs["worker1"].pid, flush=True)
got = rpcnb.run("worker1", "import torch\\ntorch.ones(16 << 20)", fetch=True)
pushed = rpcnb.run("worker1", "big.sum().item()", push={"big": torch.ones(16 << 20)}, fetch=True)
print(got.sum().item(), pushed, flush=True)
rpcnb.shutdown()
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed "
                    "(Debian's strace; make test installs it where it runs as root)")
@pytest.mark.skipif(bool(machine.cuda_devices()),
                    reason="with GPUs UCX keeps its own rendezvous scheme on one host")
def test_on_one_host_the_kernel_never_copies_a_peers_memory_itself(tmp_path):
    """UCX has no peer error handling on one host: a process whose CMA copy fails because
    the peer died mid-way is aborted. The kernel lets its peers do every copy (it asks a
    sender to write into it, and a worker reads what the kernel sends), so a worker killed
    mid-transfer can take down no more than itself. strace shows who copied."""
    log = tmp_path / "strace.log"
    code, out, err, _ = run_watched(
        ["strace", "-f", "-e", "trace=process_vm_readv,process_vm_writev", "-o", str(log),
         sys.executable, "-c", KERNEL_COPIES], timeout=180, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    assert code == 0, err[-3000:]
    # ``got`` is still alive at exit, over a buffer of the receive pool: no BufferError
    assert "Traceback" not in err, err[-3000:]
    lines = out.split("\n")
    kernel, worker = (int(p) for p in lines[0].split())
    assert lines[1].split() == ["16777216.0", "16777216.0"], out  # 64 MB each way
    copies: dict[int, int] = {}  # the process whose memory was copied -> bytes
    for call in re.finditer(r"process_vm_(?:readv|writev)\((\d+), .*?\) = (\d+)",
                            log.read_text()):
        copies[int(call[1])] = copies.get(int(call[1]), 0) + int(call[2])
    # both tensors went by CMA, each copied by the worker: into and out of the kernel
    assert copies.get(kernel, 0) >= 2 * 64 * MB, copies
    assert copies.get(worker, 0) < MB, copies  # the kernel copied nothing of the worker's


def _ns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_ucx_between_two_network_namespaces_with_a_headless_worker(kernel, netns, tmp_path):
    """A kernel and its worker1 on one host, ``python -m rpcnb.worker --join ... --ucx`` in
    a second network namespace joined by a veth pair: values cross over UCX's TCP,
    telemetry says "ucx: tcp", and UCX listens only on the group's addresses."""
    ns, here = netns["ns"], netns["here"]
    addr = subprocess.run(["ip", "-4", "-o", "addr", "show", here], capture_output=True,
                          text=True).stdout.split()[3].split("/")[0]
    kernel.execute("%load_ext rpcnb")
    kernel.execute(f"%rpc_init --workers 1 --port 0 --host {addr} --allow-remote --ucx")
    kernel.execute("import rpcnb.session.state, shutil, os, torch\n_s = rpcnb.session.state.current()")
    token = tmp_path / "connection.json"
    kernel.execute(f"shutil.copy(_s.connection_path, {str(token)!r})")
    os.chmod(token, 0o600)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    env.pop(ucx.ENV, None)  # the flag alone asks for UCX
    log = tmp_path / "worker2.log"
    proc = None
    try:
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "rpcnb.worker", "--join",
                 kernel.value("_s.init_method"), "--token-file", str(token), "--name",
                 "worker2", "--ucx"], stdout=f, stderr=subprocess.STDOUT, env=env)
        assert wait_until(lambda: proc.poll() is not None or "worker2" in kernel.value(
            "[n for n, _ in _s.admitted()]"), 120), log.read_text()[-2000:]
        assert proc.poll() is None, log.read_text()[-2000:]
        members = worker_pids(kernel)
        assert members["worker2"] in _ns_pids(ns)  # it is in the other namespace
        # a function of the notebook's (torch's builtin ops take TorchScript's path)
        kernel.execute("import torch.distributed.rpc as rpc\nfrom rpcnb.paths import ucx\n"
                       "def echo(t):\n    return t\n_before = ucx.stats()")
        # below RPCNB_UCX_TCP_THRESHOLD (32 MB) TensorPipe's TCP is faster than UCX's: the
        # first tensor takes UCX, which finds TCP to the peer, and the next one TensorPipe
        for _ in range(2):
            assert kernel.value("(lambda x: bool(torch.equal(rpc.rpc_sync('worker2', echo, "
                                "args=(x,)), x)))(torch.rand(2**20))") is True
        assert kernel.value("ucx.stats()['sent'] - _before['sent']") == 1
        assert kernel.value("ucx.transports()['worker2']") == "tcp"
        # every dtype over UCX across the namespaces, with the TCP threshold at 1 MB here
        # and on worker2 (which sends the replies)
        kernel.execute("ucx.link().tcp_threshold = 2**20\n"
                       "rpcnb.run('worker2', 'from rpcnb.paths import ucx\\n"
                       "ucx.link().tcp_threshold = 2**20')\n"
                       "_before = ucx.stats()")
        for dtype in ("float32", "float64", "int64", "bfloat16", "bool"):
            same = kernel.value(
                f"(lambda x: bool(torch.equal(rpc.rpc_sync('worker2', echo, "
                f"args=(x,)), x)))((torch.rand(2**19, 3) * 100).to(torch.{dtype}))")
            assert same is True, dtype
        counts = kernel.value("{k: ucx.stats()[k] - _before[k] for k in ('sent', 'received')}")
        assert counts == {"sent": 5, "received": 5}
        # member to member across the namespaces, and back: a cell on worker1
        out = kernel.execute(
            "%%remote worker1 --fetch\nimport torch, torch.distributed.rpc as rpc\n"
            "from rpcnb.paths import ucx\nx = torch.rand(2**20)\ndef echo(t):\n    return t\n"
            "(bool(torch.equal(rpc.rpc_sync('worker2', echo, args=(x,)), x)), "
            "ucx.transports().get('worker2'))").text
        assert "(True, 'tcp')" in out, out
        assert kernel.value("ucx.transports()['worker2']") == "tcp"
        assert kernel.value("__import__('rpcnb.telemetry').telemetry.peer_stats()"
                            "['worker2']['ucx']") == "ucx: tcp"
        assert "worker0 -> worker2: ucx: tcp" in kernel.execute("%rpc_channels --text").stdout
        # UCX listens where TensorPipe does: the veth address (and loopback), nothing else
        for pid in (kernel.pid, members["worker1"]):
            for listened in listening_addresses(pid):
                host = listened.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")
                assert host in (addr, "127.0.0.1", "::1"), (pid, listened)
        kernel.execute("%rpc_shutdown")
        assert proc.wait(30) == 0, log.read_text()[-2000:]
        assert "unused environment variable" not in log.read_text()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)
        kill_all([p for p in _ns_pids(ns) if pid_alive(p)])


def _threads_and_fds() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def test_nothing_left_after_shutdown(no_api_group):
    seen = Seen()
    try:
        rpcnb.init(1, shm=False)  # the same group without UCX: what torch and rpcnb leave
        rpc.rpc_sync("worker1", echo, args=(torch.ones(2 * MB),))
        seen.update(started_here())
        rpcnb.shutdown()
        plain = _threads_and_fds()
        rpcnb.init(1, ucx=True, shm=False)
        rpc.rpc_sync("worker1", echo, args=(torch.ones(2 * MB),))
        assert ucx.stats()["endpoints"] == 1
        link = ucx.link()  # the group's UCX, given back at shutdown
        seen.update(started_here())
        rpcnb.shutdown()
        assert ucx.stats()["endpoints"] == 0 and not ucx.is_active()
        assert link is not None and link.stats()["endpoints"] == 0 and not link.active
        assert link.worker is None and link.ctx is None
        assert wait_until(lambda: _threads_and_fds() <= plain, 5), (_threads_and_fds(), plain)
        warm = launch.current_launcher()  # stays for the next group, by design
        assert not [p for p in seen if pid_alive(p) and (warm is None or p != warm.pid)]
    finally:
        seen.update(started_here())
        if state.is_initialized():
            rpcnb.shutdown()
        seen.kill()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device on this machine: the UCX path for CUDA tensors "
                           "is written but cannot run here")
def test_cuda_tensors_over_ucx(ucx_group):
    x = torch.arange(4 * MB, dtype=torch.float32, device="cuda:0")
    out = rpcnb.run("worker1", "x * 2", push={"x": x}, fetch=True)
    assert out.is_cuda and torch.equal(out, x * 2)
