"""%rpc_doctor: each finding produced on purpose on a real member and seen in the report.
A headless worker runs in a private mount namespace with a 32 MB /dev/shm (as a container
gives) and a container marker; the connection file is opened to other users. Rules that
need a machine-wide setting (ptrace scope, InfiniBand, clock skew) are checked on this
process's real report with that one fact changed: changing them on the machine would
change them for every other process on it."""

from __future__ import annotations

import json
import os
import time

import pytest
from conftest import private_shm_blocker, small_shm_worker, worker_pids

from rpcnb.observe import doctor
from rpcnb.procs.processes import kill_all


def test_doctor_reports_a_small_shm_a_container_and_an_open_token(rpcnb_kernel, tmp_path):
    why = private_shm_blocker()
    if why:
        pytest.skip(why)
    rpcnb_kernel.execute("%rpc_init --workers 1")
    conn = rpcnb_kernel.value(
        "str(__import__('rpcnb.session.state').session.state.current().connection_path)")
    log = tmp_path / "tiny.log"
    proc = small_shm_worker(conn, "tiny", log)
    try:
        deadline = time.monotonic() + 90
        while "tiny" not in worker_pids(rpcnb_kernel) and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.3)
        assert "tiny" in worker_pids(rpcnb_kernel), log.read_text()[-2000:]

        out = rpcnb_kernel.execute("%rpc_doctor")  # a widget; its plain text is the report
        assert "application/vnd.jupyter.widget-view+json" in out.results[0]
        text = out.text
        plain = rpcnb_kernel.execute("%rpc_doctor --text").stdout  # the same report, printed
        assert "containers default to 64 MB" in plain and "1 problem found" in plain, plain
        lines = text.splitlines()
        shm = next(i for i, line in enumerate(lines) if "tiny" in line and "/dev/shm" in line)
        assert lines[shm].startswith("!!") and "32 MB" in lines[shm], text
        assert "containers default to 64 MB" in lines[shm + 1], text
        assert any("tiny" in line and "container=podman" in line for line in lines), text
        assert "1 problem found" in text, text

        found = json.loads(rpcnb_kernel.execute("%rpc_doctor --json").stdout)
        by = {(f["member"], f["check"]): f for f in found}
        assert by[("worker1", "/dev/shm")]["level"] == "ok"  # the machine's own /dev/shm
        assert by[("tiny", "/dev/shm")]["level"] == "warn"
        assert "container=podman" not in by.get(("worker1", "container"), {}).get("detail", "")
        assert by[("worker0", "token")]["level"] == "ok"
        assert by[("all", "versions")]["level"] == "ok"
        assert "127.0.0.1 (lo)" in by[("tiny", "interface")]["detail"]
        assert by[("tiny", "clock")]["level"] == "ok"

        os.chmod(conn, 0o644)  # a connection file others can read: the secret is out
        text = rpcnb_kernel.execute("%rpc_doctor --text").stdout
        assert f"chmod 600 {conn}" in text and "2 problems found" in text, text
        os.chmod(conn, 0o600)
        rpcnb_kernel.execute("%rpc_shutdown")
        proc.wait(30)
        assert proc.returncode == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            pids = [proc.pid]
            proc.kill()
            proc.wait(5)
            kill_all(pids)


def test_doctor_rules_on_this_process_report():
    here = doctor.local_report()
    assert here["pid"] == os.getpid() and here["shm_total"] > 0

    def one(**changed):
        return {(f.check, f.level): f for f in doctor.findings({"w": dict(here, **changed)})}

    f = one(ptrace_scope=2)[("cma", "warn")]
    assert "ptrace_scope" in f.todo
    f = one(ib={"mlx5_0": ["1: 4: ACTIVE"], "mlx5_1": ["1: 4: ACTIVE"]}, fork_safe={})
    assert ("infiniband", "warn") in f and ("rdma fork", "warn") in f
    assert "RDMAV_FORK_SAFE=1" in f[("rdma fork", "warn")].todo
    assert ("clock", "warn") in one(skew_s=3.0) and ("clock", "ok") in one(skew_s=0.01)
    two = doctor.findings({"a": here, "b": dict(here, torch="2.4.0")})
    assert {f.member for f in two if f.check == "versions" and f.level == "warn"} == {"a", "b"}


def test_doctor_says_the_platform_and_whether_torch_was_tested():
    here = doctor.local_report()
    assert here["platform"].startswith("Linux ")
    found = {(f.check, f.level): f for f in doctor.findings({"w": here})}
    assert "runs on Linux only" in found[("platform", "ok")].detail
    assert ("versions", "ok") in found  # this run's torch is one of the tested ones
    old = {(f.check, f.level): f for f in doctor.findings({"w": dict(here, torch="2.4.0")})}
    assert "tested with torch 2.13 and 2.14" in old[("versions", "note")].todo
