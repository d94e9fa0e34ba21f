"""ipyparallel engines as members (rpcnb.integrations.ipyparallel): a real ipyparallel cluster started with
its local launcher (and, where Open MPI is installed, its MPI launcher), real engines,
real torch RPC over loopback, driven from a real kernel. Every process a test starts is
stopped by pid at its end (conftest's kernel fixture stops the kernel's descendants, the
engines among them)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import Seen, worker_pids

from rpcnb import errors
from rpcnb.procs.processes import descendants, pid_alive

pytest.importorskip("ipyparallel", reason="ipyparallel is not installed (the test extra has it)")


def start_line(tmp_path: Path, engines: int = 2, extra: str = "") -> str:
    # a profile of the test's own: nothing of the user's ~/.ipython is touched
    return f"%rpc_init --engines {engines} --cluster-args 'profile_dir={tmp_path / 'profile'}' {extra}"


def wait_gone(pids: list[int], timeout: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def test_local_engines_are_a_group(kernel, tmp_path):
    kernel.execute("%load_ext rpcnb")
    t0 = time.monotonic()
    out = kernel.execute(start_line(tmp_path))
    started = time.monotonic() - t0
    table = out.stdout
    assert "worker1" in table and "worker2" in table and table.count(" engine ") == 2, table
    assert "127.0.0.1 (lo)" in table
    pids = worker_pids(kernel)
    kernel.execute("import os, rpcnb.integrations.ipyparallel\nrc = rpcnb.integrations.ipyparallel.client()")
    engine_pids = kernel.value("dict(zip(['worker%d' % (i + 1) for i in rc.ids], "
                               "rc[:].apply_sync(os.getpid)))")
    assert engine_pids == {k: v for k, v in pids.items() if k != "worker0"}

    # an RRef round trip, a tensor pushed and one fetched
    kernel.execute("%%remote worker1 -o r\nimport torch\nt = torch.arange(4.)\nt * 2")
    assert kernel.value("r.to_here().tolist()") == [0.0, 2.0, 4.0, 6.0]
    kernel.execute("import torch\nbig = torch.ones(250_000)")
    assert kernel.execute("%%remote worker2 --push big --fetch\nfloat(big.sum())").text == "250000.0"
    kernel.execute("%%remote worker2 -o back\nbig * 3")
    assert kernel.value("float(back.to_here().sum())") == 750000.0

    # %%remote and %%px run in the engine's one namespace
    kernel.execute("%%px --targets 0\nfrom_px = 'set by %%px'")
    assert kernel.execute("%%remote worker1 --fetch\nfrom_px").text == "'set by %%px'"
    kernel.execute("%%remote worker1\nfrom_remote = 6 * 7")
    px = kernel.execute("%%px --targets 0\nprint(from_remote)")  # %px's output is a display
    shown = "".join(d["data"].get("text/plain", "") for d in px.displays)
    assert "[stdout:0] 42" in shown, px.displays
    out = kernel.execute("%%remote worker2\nprint('streamed from', __import__('os').getpid())")
    assert f"streamed from {pids['worker2']}" in out.stdout

    # an engine killed by pid: a clear error naming it within 5 s, the group goes on
    os.kill(pids["worker2"], signal.SIGKILL)
    t0 = time.monotonic()
    died = kernel.execute("%%remote worker2 --fetch\n1", allow_error=True)
    while "died" not in died.traceback and time.monotonic() - t0 < 5:
        time.sleep(0.2)
        died = kernel.execute("%%remote worker2 --fetch\n1", allow_error=True)
    assert time.monotonic() - t0 < 5, died.traceback
    assert "Worker 'worker2' died (its engine process is gone)" in died.traceback
    assert kernel.execute("%%remote worker1 --fetch\n40 + 2").text == "42"
    assert "no: its engine process is gone" in kernel.execute("%rpc_workers").text

    # %rpc_shutdown stops the cluster this group started
    kernel.execute("%rpc_shutdown")
    assert wait_gone([pids["worker1"]]) == []
    print(f"started 2 engines as members in {started:.1f} s")


@pytest.fixture
def outside_cluster(tmp_path):
    """A cluster the user runs already (started here, by ipyparallel's own API); its
    controller and engines are stopped by pid at the end."""
    import ipyparallel as ipp

    # ipyparallel starts the controller and the engines as children of this process: those
    # are stopped, not every descendant (the shared kernel of rpcnb_kernel is one too)
    before = Seen(c.pid for c in psutil.Process().children())
    cluster = ipp.Cluster(n=2, profile_dir=str(tmp_path / "outside"), log_level=40)
    cluster.start_cluster_sync()
    try:
        rc = cluster.connect_client_sync()
        rc.wait_for_engines(2, timeout=60)
        yield cluster, rc
    finally:
        mine = Seen(c.pid for c in psutil.Process().children()).since(before)
        mine |= [p for pid in mine.started for p in descendants(pid)]
        try:
            rc.close()
            cluster.stop_cluster_sync()
        except Exception:
            pass
        mine.kill()


def test_attach_leaves_the_engines_running(rpcnb_kernel, outside_cluster):
    cluster, rc = outside_cluster
    engines = rc[:].apply_sync(os.getpid)
    rc[:].execute("before = 'the engine had this'", block=True)
    out = rpcnb_kernel.execute(f"%rpc_init --attach {cluster.profile_dir}:{cluster.cluster_id}")
    assert "worker1" in out.stdout and "worker2" in out.stdout
    members = worker_pids(rpcnb_kernel)
    assert sorted(members.values()) == sorted([*engines, members["worker0"]])
    assert rpcnb_kernel.execute("%%remote worker2 --fetch\nbefore").text == "'the engine had this'"
    rpcnb_kernel.execute("%%remote --all\nafter = 'rpcnb left this'")
    rpcnb_kernel.execute("%rpc_shutdown")
    # the engines run on, in the group no more, with their namespace
    assert all(pid_alive(p) for p in engines)
    rc[:].execute("import rpcnb.session.state\ninside = rpcnb.session.state.is_initialized()", block=True)
    assert rc[:].pull("inside", block=True) == [False, False]
    assert rc[:].pull("after", block=True) == ["rpcnb left this"] * 2
    # and can be attached again by a new group
    rpcnb_kernel.execute(f"%rpc_init --attach {cluster.profile_dir}:{cluster.cluster_id}")
    assert rpcnb_kernel.execute("%%remote worker1 --fetch\nafter").text == "'rpcnb left this'"
    rpcnb_kernel.execute("%rpc_shutdown")


def test_cluster_args_reach_ipyparallel_as_written():
    from rpcnb.integrations.ipyparallel import parse_cluster_args

    # as IPython hands over a magic's line: the double quotes stay on the value
    line = "\"profile_dir=/tmp/p n=3 MPILauncher.mpi_args=['--allow-run-as-root','--oversubscribe']\""
    assert parse_cluster_args(line) == (
        {"profile_dir": "/tmp/p", "n": 3},
        {"MPILauncher": {"mpi_args": ["--allow-run-as-root", "--oversubscribe"]}})
    assert parse_cluster_args("'profile_dir=/tmp/a b' controller_ip=10.0.0.1") == (
        {"profile_dir": "/tmp/a b", "controller_ip": "10.0.0.1"}, {})
    with pytest.raises(ValueError, match="is not an ipyparallel setting"):
        parse_cluster_args("profile_dir")


def test_bad_cluster_lines_say_what_to_do(rpcnb_kernel):
    for line, message in [
        ("%rpc_init --engines 0", errors.BAD_ENGINES.format(engines=0)),
        ("%rpc_init --engines 2 --launcher carrier-pigeon", "is not one of ipyparallel's launchers"),
        ("%rpc_init --engines 2 --workers 2", errors.ENGINES_AND_WORKERS),
        ("%rpc_init --launcher mpi", errors.LAUNCHER_NEEDS_ENGINES),
        ("%rpc_init --engines 1 --cluster-args 'oops'", "is not an ipyparallel setting"),
        ("%rpc_init --attach no-such-cluster-here", "No running ipyparallel cluster 'no-such-cluster-here'"),
    ]:
        out = rpcnb_kernel.execute(line, allow_error=True)
        assert message in out.traceback, (line, out.traceback)
    assert not rpcnb_kernel.value("__import__('rpcnb.session.state').session.state.is_initialized()")


def test_engines_that_never_register_are_named_with_what_they_printed(kernel, tmp_path):
    # an engine command that starts, says why it cannot go on, and waits: ipyparallel's
    # timeout alone says "not ready"; the error shows each engine's own last words
    script = tmp_path / "stuck_engine.py"
    script.write_text("import time\nprint('waiting for a licence server', flush=True)\n"
                      "time.sleep(600)\n")
    kernel.execute("%load_ext rpcnb")
    out = kernel.execute(
        f"%rpc_init --engines 2 --cluster-args \"profile_dir={tmp_path / 'profile'} "
        f"engine_timeout=5 LocalEngineSetLauncher.engine_cmd=['{sys.executable}','{script}']\"",
        allow_error=True, timeout=90)
    assert "2 engines not ready in 5 seconds" in out.traceback, out.traceback
    for engine in ("0", "1"):
        assert f"engine {engine} printed:\n  waiting for a licence server" in out.traceback, \
            out.traceback
    assert not wait_gone([p for p in descendants(kernel.pid)
                          if "stuck_engine" in " ".join(_cmdline(p))])
    assert not kernel.value("__import__('rpcnb.session.state').session.state.is_initialized()")


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


MPIEXEC = shutil.which("mpiexec")


def test_mpi_engines_are_a_group(kernel, tmp_path):
    if MPIEXEC is None:
        pytest.skip("Open MPI's mpiexec is missing (make cluster-deps installs openmpi-bin)")
    pytest.importorskip("mpi4py", reason="ipyparallel's MPI engines need mpi4py (the test extra has it)")
    args = "MPILauncher.mpi_args=['--oversubscribe']"
    if os.geteuid() == 0:  # Open MPI refuses root without it
        args = "MPILauncher.mpi_args=['--allow-run-as-root','--oversubscribe']"
    kernel.execute("%load_ext rpcnb")
    out = kernel.execute(f"%rpc_init --engines 2 --launcher mpi "
                         f"--cluster-args \"profile_dir={tmp_path / 'p'} {args}\"")
    assert out.stdout.count(" engine ") == 2
    ranks = kernel.execute("%%remote --all --fetch\nimport os\nos.environ['OMPI_COMM_WORLD_RANK']").text
    assert "'0'" in ranks and "'1'" in ranks
    kernel.execute("%%remote worker1 -o r\nimport torch\ntorch.full((3,), 2.0)")
    assert kernel.value("r.to_here().tolist()") == [2.0, 2.0, 2.0]
    pids = worker_pids(kernel)
    kernel.execute("%rpc_shutdown")
    assert wait_gone([pids["worker1"], pids["worker2"]]) == []
