"""One teardown: a start that fails at any step leaves nothing behind, and so does
%rpc_shutdown after real traffic. The failure is injected after each step that
``rpcnb.init`` registers on the group's teardown stack (rpcnb.session.teardown), in a real
process that starts a real worker, serves its rendezvous over TCP and sends a tensor
through shared memory; after each failure the process looks for what is left: worker
processes, listening ports, /dev/shm segments, group folders. Each failed start is
followed by the next one in the same process, so a failure also leaves ``init`` usable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

PROGRAM = r'''
import glob, json, os, sys, tempfile
import psutil
import rpcnb
from rpcnb.paths import shm
from rpcnb.procs import launch
from rpcnb.session import teardown

steps, fail_at = [], [0]
push = teardown.Teardown.push
me = psutil.Process()
ours = {me.pid}  # this process and every process it started: /dev/shm is the machine's

def note_ours():
    ours.update(p.pid for p in me.children(recursive=True))

def failing_push(self, name, cleanup, *, last=False):
    push(self, name, cleanup, last=last)
    note_ours()
    steps.append(name)
    if len(steps) == fail_at[0]:
        raise RuntimeError(f"injected failure after {name!r}")

teardown.Teardown.push = failing_push

def left():
    launcher = launch.WARM.launcher
    spared = {launcher.proc.pid} if launcher is not None else set()
    workers = [p.pid for p in me.children(recursive=True)
               if p.pid not in spared and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    ports = [c.laddr.port for c in me.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    return {"workers": workers, "ports": ports,
            "folders": glob.glob(os.path.join(tempfile.gettempdir(), "rpcnb-*")),
            "segments": [f for f in shm.leftovers() if int(f.rsplit("-", 2)[1]) in ours]}

def total(x):
    return int(x.sum())

def big_send():
    import torch
    import torch.distributed.rpc as rpc
    x = torch.ones(16 << 20)  # 64 MB to a Python function: rpcnb's shared memory on one host
    assert rpc.rpc_sync("worker1", total, args=(x,)) == x.numel()
    note_ours()

report = {"clean": left()}
rpcnb.init(1, port=0)  # every step, nothing injected: the stack's steps in order
report["steps"] = list(steps)
big_send()
report["segments_in_use"] = bool(left()["segments"])
rpcnb.shutdown()
report["after_shutdown"] = left()
n = len(report["steps"])
report["stages"] = {}
for k in range(1, n + 1):
    steps.clear()
    fail_at[0] = k
    try:
        rpcnb.init(1, port=0)
    except RuntimeError as exc:
        report["stages"][report["steps"][k - 1]] = {"error": str(exc), **left()}
    else:
        report["stages"][report["steps"][k - 1]] = {"error": None}
        rpcnb.shutdown()
fail_at[0] = 0
rpcnb.init(1, port=0)  # after every failure, a start still works
big_send()
rpcnb.shutdown()
report["last"] = left()
print("REPORT " + json.dumps(report))
'''

NOTHING = {"workers": [], "ports": [], "folders": [], "segments": []}


@pytest.fixture
def report(tmp_path: Path) -> dict:
    """Run the program above in a fresh process with a private temp folder (so the group
    folders it finds are its own); it and everything it started are stopped by pid."""
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)] \
                if psutil.pid_exists(proc.pid) else []:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.kill()
        proc.wait()
    lines = [line for line in out.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, out[-4000:]
    return json.loads(lines[-1].removeprefix("REPORT "))


def test_a_failed_start_at_any_step_and_a_shutdown_leave_nothing(report: dict):
    assert report["clean"] == NOTHING
    # what a TCP group with one worker sets up, each registered as it comes up
    assert report["steps"][:3] == ["group folder", "rendezvous store", "cell runner"]
    for step in ("session", "shared memory", "UCX", "torch's RPC agent", "worker worker1",
                 "death watcher"):
        assert step in report["steps"]
    assert report["segments_in_use"], "the 64 MB tensor did not take the shared-memory path"
    assert report["after_shutdown"] == NOTHING
    assert set(report["stages"]) == set(report["steps"])
    for step, found in report["stages"].items():
        assert found.pop("error") == f"injected failure after {step!r}"
        assert found == NOTHING, f"a start that failed after {step!r} left {found}"
    assert report["last"] == NOTHING
