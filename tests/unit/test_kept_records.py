"""What the registry of kept groups says of the kernel attached to one (the panel's and
%rpc_groups' "attached" column), read from records as the keeper writes them."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rpcnb.membership import kept
from rpcnb.procs.processes import pid_alive


def ended_pid() -> int:
    """A pid no process has now (a kernel that ended)."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    return next(p for p in range(top - 1, 1, -1) if not pid_alive(p))


def test_a_kernel_that_ended_is_not_attached_before_the_keeper_notices(tmp_path, monkeypatch):
    monkeypatch.setenv("RPCNB_RUNTIME_DIR", str(tmp_path))
    rec = kept.Record(name="group1", keep_s=60, attached="kernel_1", attached_pid=ended_pid())
    assert kept.attached(rec) == ""
    rec.attached_pid = os.getpid()
    assert kept.attached(rec) == "kernel_1"
    # a kernel that claimed the group before the keeper's record says so counts
    rec.attached, rec.attached_pid = "", 0
    kept.folder("group1").mkdir(parents=True)
    (kept.folder("group1") / "attached.pid").write_text(str(os.getpid()))
    assert kept.attached(rec) == f"kernel_{os.getpid()}"


def test_idle_since_the_kernel_ended_even_before_the_record_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("RPCNB_RUNTIME_DIR", str(tmp_path))
    rec = kept.Record(name="group1", keep_s=60, attached="kernel_1", attached_pid=ended_pid())
    t0 = time.time()
    since = kept.describe(rec)["idle_since"]
    assert since is not None and since >= t0
    assert kept.idle_text(rec).endswith(" s of 60 s")
    rec.attached_pid = os.getpid()
    assert kept.describe(rec)["idle_since"] is None
    rec.attached, rec.attached_pid, rec.idle_since = "", 0, t0 - 42
    assert kept.describe(rec)["idle_since"] == t0 - 42
    assert kept.idle_text(rec, now=t0).startswith("42 s")
