"""Where a member is now, without a group: a cell runner says which cell it runs, since
when and at which line (a function of the cell included), and its stack from the cell's
own frame on; a process's threads come as %rpc_stacks shows them (the cell's first, a
user's thread in full, helpers one line each); %rpc_workers' table says who is busy, and
with what; a member with no stack says why.

A cell runs on a runner thread of this process, as in a kernel that joined a group.
"""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from rpcnb import errors  # noqa: E402
from rpcnb.cells.runner import CellRunner, Job  # noqa: E402
from rpcnb.observe import stacks  # noqa: E402
from rpcnb.session.members import Group, Member, Status, busy_line  # noqa: E402

CELL = """\
import time
def wait_here():
    started.set()
    gate.wait(30)
wait_here()
"""


@pytest.fixture
def busy_runner():
    """A runner (member "w9") whose cell waits in ``wait_here`` until the test ends."""
    started, gate = threading.Event(), threading.Event()
    runner = CellRunner("w9", {"started": started, "gate": gate})
    runner.start_thread()
    job = Job("token", "call-1", "w0", CELL, False, {}, runner.future())
    runner.submit(job)
    assert started.wait(10)
    yield runner
    gate.set()
    job.future.wait()
    runner.stop()


def test_a_running_cell_says_where_it_is_and_its_stack_starts_at_the_cell(busy_runner):
    found = busy_runner.running(stack=True)
    assert found is not None
    assert (found.cell, found.first, found.call_id, found.caller) == (
        "<w9 cell 1>", "import time", "call-1", "w0")
    assert (found.file, found.line, found.text) == ("<w9 cell 1>", 4, "gate.wait(30)")
    assert found.thread_name == "rpcnb-cells-w9" and 0 <= found.seconds < 10
    assert abs(time.time() - found.seconds - found.since) < 1
    # from the cell's own frame in: rpcnb's runner frames around it left out
    assert found.stack[:2] == [("<w9 cell 1>", 5, "<module>", "wait_here()"),
                               ("<w9 cell 1>", 4, "wait_here", "gate.wait(30)")]
    assert all("rpcnb" not in f[0] for f in found.stack)
    assert busy_runner.running().stack == []  # without stack=True, no frames


def test_an_idle_runner_runs_nothing():
    runner = CellRunner("w8", {})
    assert runner.running() is None
    runner.start_thread()
    assert runner.running(stack=True) is None
    runner.stop()


def _user_code(ready: threading.Event, gate: threading.Event) -> None:
    ready.set()
    gate.wait(30)


def test_a_members_threads_the_cells_first_a_users_in_full_helpers_in_a_line(busy_runner):
    ready, gate = threading.Event(), threading.Event()
    mine = threading.Thread(target=_user_code, args=(ready, gate), name="my-loader")
    helper = threading.Thread(target=gate.wait, args=(30,), name="lib-helper")
    mine.start()
    helper.start()
    try:
        assert ready.wait(10)
        answer = stacks.here(SimpleNamespace(name="w9", runner=busy_runner))
    finally:
        gate.set()
        mine.join()
        helper.join()
    kinds = {t["name"]: t["kind"] for t in answer["threads"]}
    assert answer["threads"][0]["name"] == "rpcnb-cells-w9"
    assert kinds["rpcnb-cells-w9"] == "cell" and kinds["my-loader"] == "user"
    assert kinds["lib-helper"] == "idle"
    assert threading.current_thread().name not in kinds  # the thread that asks is left out
    text = stacks.MemberStacks("w9", "answered", running=answer["running"],
                               threads=answer["threads"]).text()
    lines = text.splitlines()
    assert lines[0].startswith("w9, thread rpcnb-cells-w9: running <w9 cell 1> since "), text
    assert lines[1:5] == ['  File "<w9 cell 1>", line 5, in <module>', "    wait_here()",
                          '  File "<w9 cell 1>", line 4, in wait_here', "    gate.wait(30)"]
    # a user's thread: from its own first frame (threading's bootstrap left out) in
    user = text.split("w9, thread my-loader:\n")[1].splitlines()
    assert user[0].endswith(", in _user_code") and user[1] == "    gate.wait(30)", text
    assert "_bootstrap" not in text.split("w9, thread my-loader:")[1].split("idle threads")[0]
    assert "lib-helper: wait (threading.py:" in text, text


def test_a_member_with_no_stack_says_why():
    dead = stacks.MemberStacks("worker2", "dead", "killed by SIGKILL")
    assert dead.text() == errors.STACKS_DEAD.format(name="worker2", how="killed by SIGKILL")
    silent = stacks.MemberStacks("worker3", "silent", "1 s")
    assert silent.text().startswith("worker3: did not answer within 1 s: ")
    gone = stacks.MemberStacks("worker4", "unreachable", "14:02:11")
    assert gone.text() == errors.STACKS_UNREACHABLE.format(name="worker4", since="14:02:11")
    idle = stacks.MemberStacks("worker5", "answered", threads=[])
    assert idle.text() == f"worker5: {errors.STACKS_IDLE}"
    both = stacks.Stacks("worker0", [dead, idle], 0.01)
    assert str(both) == dead.text() + "\n\n" + idle.text()


def test_the_table_says_who_is_busy_with_what_and_where():
    since = time.time() - 12
    busy = {"cell": "<worker1 cell 3>", "first": "for i in range(600):", "since": since,
            "file": "<worker1 cell 3>", "line": 2, "text": "time.sleep(0.1)"}
    group = Group("worker0", "worker0", "/tmp/c.json", [
        Member("worker0", 0, kind="kernel"),
        Member("worker1", 1, busy=busy),
        Member("worker2", 2, status=Status.DEAD, how="killed by SIGKILL", busy=busy),
    ])
    head, *rows = group.table().splitlines()
    col = head.index(" busy ") + 1
    assert [r[col:col + 4].strip() for r in rows] == ["no", "yes", "-"]
    clock = time.strftime("%H:%M:%S", time.localtime(since))
    # (the seconds as the line is written: 12, or more on a machine that stalls)
    assert re.fullmatch(rf"worker1 runs <worker1 cell 3> \(for i in range\(600\):\) since {clock} "
                        r"\(1\d s\), at line 2: time\.sleep\(0\.1\)", group.busy()), group.busy()
    assert group.busy() in str(group)
    inner = dict(busy, file="<worker1 cell 1>", line=3, text="step()", first="x" * 60)
    assert re.search(rf"\({'x' * 37}\.\.\.\) since {clock} \(1\d s\), at line 3 of "
                     r"<worker1 cell 1>: step\(\)$", busy_line("worker1", inner))
    assert re.search(r"\(1\d s\)$", busy_line("worker1", dict(busy, file="")))
