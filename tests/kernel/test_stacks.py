"""Where a worker is now, in real kernels: %rpc_stacks answers within a second while the
worker's cell sleeps in a C call or waits in a gloo collective for a rank that has not
come, the running cell's thread first and named, its frames from the cell's own on;
%rpc_workers says who is busy with which cell and at which line, %rpc_jobs the line a
background cell is at, and the panel the same, with a stacks action; a frozen member is
named as not answering, and a dead one as dead, while the others' stacks still show."""

from __future__ import annotations

import os
import re
import signal

import pytest
from conftest import freeze, wait_until, worker_pids
from test_panel import close_comm, open_comm, send, snapshot_where, wait_for

from rpcnb import errors

# conftest.group: the module's group; its workers also form a gloo process group, for the
# collective that waits for a rank (a minute before a collective gives up)
GROUP_INIT = "%rpc_init --workers 2 --collectives gloo"

# a stack answered from inside the kernel, and how long the magic took, in seconds
ASK = ("import time as _t\n_t0 = _t.perf_counter()\n_st = %rpc_stacks {args}\n"
       "print(f'took {{_t.perf_counter() - _t0:.4f}}')\nprint(_st)")
TOOK = re.compile(r"^took (\d+\.\d+)$", re.M)


def start_bg(k, name: str, source: str, said: str):
    """Start ``source`` as a background cell on worker1 (its handle: ``name``) and wait
    for the line ``said`` it prints once it is where the test wants it."""
    cell = k.execute(f"%%remote worker1 --bg -o {name}\n{source}")
    if said in cell.stdout:  # printed before the starting cell itself ended
        return
    got = k.later(cell.msg_id, until=lambda msgs: any(
        said in m["content"].get("text", "") for m in msgs if m["msg_type"] == "stream"),
        timeout=60)
    assert any(said in m["content"].get("text", "") for m in got), got
    return cell


def stacks(k, args: str) -> tuple[float, str]:
    out = k.execute(ASK.format(args=args))
    found = TOOK.search(out.stdout)
    assert found, out.stdout
    return float(found.group(1)), out.stdout[found.end():].strip("\n")


def end(k, name: str) -> None:
    """Cancel the background cell ``name`` and wait until it has ended."""
    assert k.execute(f"{name}.cancel()\nprint({name}.wait(30))").stdout.strip() == "True"


@pytest.mark.serial
def test_stacks_of_a_worker_asleep_in_a_cell_function_within_a_second(group):
    k = group
    start_bg(k, "nap_job", "import time\ndef nap():\n    print('asleep', flush=True)\n"
                           "    time.sleep(30)\nnap()", "asleep")
    took, text = stacks(k, "worker1")
    assert took < 1.0, (took, text)
    lines = text.splitlines()
    # the running cell's thread comes first, named with the cell, since when and who sent it
    assert re.match(r"worker1, thread MainThread: running <worker1 cell \d+> since "
                    r"\d\d:\d\d:\d\d \(\d+\.\d s\), sent by worker0:$", lines[0]), text
    cell = re.search(r"<worker1 cell \d+>", lines[0]).group(0)
    # its frames start at the cell's own (rpcnb's runner left out) and end in time.sleep
    assert lines[1:5] == [f'  File "{cell}", line 5, in <module>', "    nap()",
                          f'  File "{cell}", line 4, in nap', "    time.sleep(30)"], text
    first = text.split("\n\n")[0]
    assert "rpcnb/cells/runner.py" not in first.split("idle threads")[0], text
    # rpcnb's and torch's threads that wait for work: one line each, after the cell's
    assert re.search(r"worker1, \d+ idle threads \(rpcnb, torch, the kernel\):\n"
                     r"(  .+\n)*  rpcnb-output: ", text + "\n"), text
    # the default: every member but this kernel; worker2 runs nothing
    took, every = stacks(k, "")
    assert took < 1.0, (took, every)
    assert every.startswith("worker1, thread MainThread: running"), every
    assert f"worker2: {errors.STACKS_IDLE}" in every
    assert re.search(r"^worker2, \d+ idle threads .*\n  MainThread: waits for a cell", every,
                     re.M), every
    assert not any(line.startswith("worker0") for line in every.splitlines())  # not this kernel
    end(k, "nap_job")


def test_stacks_of_a_worker_waiting_in_a_gloo_collective(group):
    k = group
    coll = "import torch\nimport torch.distributed as dist\nt = torch.ones(1)\n"
    start_bg(k, "coll_job", coll + "print('reducing', flush=True)\ndist.all_reduce(t)\nfloat(t)",
             "reducing")
    seen: list[str] = []

    def in_the_collective() -> bool:
        took, text = stacks(k, "worker1")
        seen.append(f"{took:.3f} s\n{text}")
        return "dist.all_reduce(t)" in text and "in all_reduce" in text

    # worker2 never calls it: worker1 waits inside gloo, a C++ call, and still answers
    assert wait_until(in_the_collective, timeout=20, poll=0.2), seen[-1]
    took, text = float(seen[-1].split(" s\n")[0]), seen[-1].split(" s\n", 1)[1]
    assert took < 1.0, seen[-1]
    head = text.splitlines()
    assert head[0].startswith("worker1, thread MainThread: running <worker1 cell "), text
    assert head[2] == "    dist.all_reduce(t)", text  # the cell's line, then torch's frames
    assert re.search(r'File ".*torch/distributed/distributed_c10d\.py", line \d+, in all_reduce',
                     text), text
    # worker2 comes: both end, and the process group goes on
    done = k.execute("%%remote worker2 --fetch\n" + coll + "dist.all_reduce(t)\nfloat(t)")
    assert done.text == "2.0"
    assert k.execute("print(coll_job.wait(30), coll_job.error())").stdout.strip() == "True None"


def test_rpc_workers_and_rpc_jobs_show_the_busy_worker_and_its_line(group):
    k = group
    start_bg(k, "loop_job", "import time\nprint('looping', flush=True)\n"
                            "for i in range(600):\n    time.sleep(0.1)", "looping")
    table = k.execute("%rpc_workers").text
    head, *rows = table.splitlines()[1:5]
    assert " busy " in head, table
    col = head.index(" busy ") + 1
    busy = {row.split()[0]: row[col:col + 4].strip() for row in rows}
    assert busy == {"worker0": "no", "worker1": "yes", "worker2": "no"}, table
    assert re.search(r"^worker1 runs <worker1 cell \d+> \(import time\) since \d\d:\d\d:\d\d "
                     r"\(\d+ s\), at line 4: time\.sleep\(0\.1\)$", table, re.M), table
    jobs = k.execute("%rpc_jobs").text
    assert re.search(r"^\[\d+\]\s+worker1\s+running\s+[\d.]+\s+import time\s+"
                     r"line 4: time\.sleep\(0\.1\)$", jobs, re.M), jobs
    end(k, "loop_job")
    table = k.execute("%rpc_workers").text
    assert " runs <worker1 cell" not in table, table
    row = next(r for r in table.splitlines() if r.startswith("worker1 "))
    assert row[col:col + 4].strip() == "no", table


def test_the_panel_shows_the_busy_worker_and_its_stacks(group):
    k = group
    start_bg(k, "panel_job", "import time\nprint('panel', flush=True)\n"
                             "for i in range(600):\n    time.sleep(0.1)", "panel")
    comm = open_comm(k)

    def worker1_busy(snap) -> bool:
        m = next((m for m in snap.get("members", []) if m["name"] == "worker1"), None)
        return bool(m and m.get("busy") and m["busy"].get("line") == 4)

    snap = wait_for(k, comm, snapshot_where(worker1_busy), timeout=30)["snapshot"]
    busy = next(m for m in snap["members"] if m["name"] == "worker1")["busy"]
    assert busy["text"] == "time.sleep(0.1)" and busy["first"] == "import time", busy
    assert re.fullmatch(r"<worker1 cell \d+>", busy["cell"]) and busy["caller"] == "worker0"
    assert "seconds" not in busy  # the front end counts from "since": no snapshot a second
    assert next(m for m in snap["members"] if m["name"] == "worker2")["busy"] is None
    send(k, comm, {"type": "action", "action": "stacks", "member": "worker1", "id": 7})
    reply = wait_for(k, comm, lambda d: d.get("type") == "reply" and d.get("id") == 7)
    assert reply["ok"], reply
    assert reply["text"].startswith("worker1, thread MainThread: running <worker1 cell"), reply
    assert "time.sleep(0.1)" in reply["text"]
    send(k, comm, {"type": "action", "action": "stacks", "member": "nobody", "id": 8})
    reply = wait_for(k, comm, lambda d: d.get("type") == "reply" and d.get("id") == 8)
    assert not reply["ok"] and "There is no worker 'nobody'" in reply["message"], reply
    end(k, "panel_job")
    wait_for(k, comm, snapshot_where(lambda s: not any(m.get("busy") for m in s["members"])),
             timeout=30)
    close_comm(k, comm)


def test_a_frozen_member_is_named_as_not_answering_and_a_dead_one_as_dead(own_group):
    k = own_group
    pids = worker_pids(k)
    freeze(pids["worker1"])
    try:
        took, text = stacks(k, "")
    finally:
        os.kill(pids["worker1"], signal.SIGCONT)
    assert took < 3.0, (took, text)
    assert text.startswith("worker1: did not answer within 1 s: "), text
    assert "%rpc_restart worker1 replaces it" in text.splitlines()[0], text
    assert f"worker2: {errors.STACKS_IDLE}" in text  # the others still show
    os.kill(pids["worker2"], signal.SIGKILL)
    assert wait_until(lambda: "no: killed by SIGKILL" in k.execute("%rpc_workers").text,
                      timeout=20, poll=0.5)
    took, text = stacks(k, "")
    assert errors.STACKS_DEAD.format(name="worker2", how="killed by SIGKILL") in text, text
    assert f"worker1: {errors.STACKS_IDLE}" in text  # worker1 answers again
    # named, it is not an error either; a name that is no member is
    assert stacks(k, "worker2")[1] == errors.STACKS_DEAD.format(name="worker2",
                                                                how="killed by SIGKILL")
    out = k.execute("%rpc_stacks nobody", allow_error=True)
    assert "There is no worker 'nobody' in the group" in out.stderr, out.stderr
    out = k.execute("%rpc_stacks worker1 --all", allow_error=True)
    assert "Give either --all or worker names" in out.stderr, out.stderr
    # --all: this kernel too, its cell runner waiting for a cell
    every = stacks(k, "--all")[1]
    assert "worker0, " in every and "rpcnb-cells-worker0: waits for a cell" in every, every
