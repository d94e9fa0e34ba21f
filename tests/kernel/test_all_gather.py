"""torch's all-gather and barriers (``rpc.api._all_gather``, ``_barrier``) in a group whose
members change: every member's view of the group's names follows a worker added, a
kernel that joined, a worker restarted; a member killed in a barrier is named in the error
the others get, instead of a hang (rpcnb.wire._gather)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from conftest import kill_all, pid_alive, wait_until

import rpcnb

API_WORKERS = 2

GATHER = ("import torch.distributed.rpc as rpc\n"
          "(sorted(rpc.api._ALL_WORKER_NAMES), rpc.api._all_gather(rpc.get_worker_info().id),"
          " rpc.api._barrier(sorted(rpc.api._ALL_WORKER_NAMES)))")


def on_every_member(source: str, timeout: float = 60) -> dict[str, Any]:
    """``source``'s last expression on every member at once: this process on a thread, the
    others as a cell; by name."""
    box: dict[str, Any] = {}

    def here() -> None:
        *body, last = source.splitlines()
        ns: dict[str, Any] = {}
        exec("\n".join(body), ns)
        box["value"] = eval(last, ns)

    thread = threading.Thread(target=here)
    thread.start()
    got = rpcnb.run(rpcnb.ALL, source, fetch=True, timeout=timeout)
    thread.join(timeout)
    assert not thread.is_alive(), "worker0's all-gather did not end"
    return {**got, "worker0": box["value"]}


def views() -> dict[str, list[str]]:
    """Every member's view of the group's names, as torch's functions read it."""
    import torch.distributed.rpc as rpc

    got = rpcnb.run(rpcnb.ALL, "import torch.distributed.rpc as rpc\n"
                    "sorted(rpc.api._ALL_WORKER_NAMES)", fetch=True, timeout=30)
    return {**got, "worker0": sorted(rpc.api._ALL_WORKER_NAMES)}


def check_everyone_agrees(names: list[str]) -> None:
    """Every member's view is ``names`` (the leader tells them as it admits a member, or
    as one dies: at once, not at their next all-gather), and an all-gather and a barrier
    over everyone work."""
    import torch.distributed.rpc as rpc

    def ranks_now() -> dict[str, int]:
        return {w.name: w.id for w in rpc._get_current_rpc_agent().get_worker_infos()}

    # a member that died: the leader marks it dead, then drops it from torch's group
    assert wait_until(lambda: sorted(ranks_now()) == names, timeout=10), ranks_now()
    ranks = ranks_now()
    assert wait_until(lambda: all(view == names for view in views().values()), timeout=10), views()
    said = on_every_member(GATHER)
    assert sorted(said) == names
    for member, (view, gathered, barrier) in said.items():
        assert view == names, member
        assert gathered == ranks, member  # each member's rank, from every member
        assert barrier is None


def test_all_gather_and_barriers_follow_joins_and_restarts(own_api_group, tmp_path: Path):
    check_everyone_agrees(["worker0", "worker1", "worker2"])

    rpcnb.add_workers(1)  # %rpc_init --add 1
    check_everyone_agrees(["worker0", "worker1", "worker2", "worker3"])

    # a member that joins by itself (as a kernel's %rpc_init --join does)
    log = open(tmp_path / "joined.log", "wb")
    joined = subprocess.Popen([sys.executable, "-m", "rpcnb.worker", "--join",
                               rpcnb.group().address, "--name", "joined"],
                              stdout=log, stderr=subprocess.STDOUT,
                              env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2])))
    try:
        assert wait_until(lambda: "joined" in {m.name for m in rpcnb.group(refresh=False).members
                                               if m.alive}, timeout=120), \
            (tmp_path / "joined.log").read_text()
        check_everyone_agrees(["joined", "worker0", "worker1", "worker2", "worker3"])

        old = {m.name: (m.rank, m.pid) for m in rpcnb.group().members}["worker1"]
        rpcnb.restart("worker1")  # %rpc_restart worker1: a new process, a new rank
        assert {m.name: (m.rank, m.pid) for m in rpcnb.group().members}["worker1"] != old
        check_everyone_agrees(["joined", "worker0", "worker1", "worker2", "worker3"])
    finally:
        joined.kill()
        joined.wait(10)
        log.close()
    assert wait_until(lambda: "joined" not in {m.name for m in rpcnb.group(refresh=False).members
                                               if m.alive}, timeout=30)
    check_everyone_agrees(["worker0", "worker1", "worker2", "worker3"])


BARRIER = ("import torch.distributed.rpc as rpc\n"
           "try:\n"
           "    rpc.api._barrier(['worker0', 'worker1', 'worker2'])\n"
           "    said = None\n"
           "except Exception as exc:\n"
           "    said = (type(exc).__name__, str(exc))\n"
           "said")


def test_a_member_killed_in_a_barrier_is_named_in_the_others_error(own_api_group):
    import torch.distributed.rpc as rpc

    pid = {m.name: m.pid for m in rpcnb.group().members}["worker2"]
    said: dict[str, Any] = {}

    def here() -> None:
        try:
            rpc.api._barrier(["worker0", "worker1", "worker2"])
        except Exception as exc:
            said["worker0"] = (type(exc).__name__, str(exc))

    thread = threading.Thread(target=here)
    thread.start()
    bg = rpcnb.run_bg("worker1", BARRIER, fetch=True)
    try:
        # worker0 leads the round: worker1's part arrived, worker2's never will
        assert wait_until(lambda: any(set(st.gathered_objects) == {"worker0", "worker1"} for st in
                                      list(rpc.api._all_gather_sequence_id_to_states.values())),
                          timeout=30)
        os.kill(pid, signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive(), "the barrier still waits for a dead member"
        said["worker1"] = bg.result(timeout=30)
    finally:
        if pid_alive(pid):
            kill_all([pid])
    for member in ("worker0", "worker1"):
        kind, message = said[member]
        assert kind == "WorkerDiedError", (member, message)
        assert "rpc.api._barrier across worker0, worker1, worker2" in message, message
        assert "Worker 'worker2' died (killed by SIGKILL)" in message, message
    # the survivors go on: a barrier of those left passes
    check_everyone_agrees(["worker0", "worker1"])

