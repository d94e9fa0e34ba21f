"""Cells whose caller went away (rpcnb.cells.orphans) and the output they keep
(rpcnb.cells.output.Capture's hold, take and resume), in this process: a kernel of a kept
group that restarts while its cell runs on a worker. The whole path, with real kernels and
workers, is tests/kernel/test_kept.py's background loop."""

from __future__ import annotations

import torch

from rpcnb.cells import orphans
from rpcnb.cells.output import HELD_CHARS, Capture
from rpcnb.cells.runner import CellResult, Job


def job(call_id: str, caller: str = "kernel_1") -> Job:
    j = Job("token", call_id, caller, "for step in range(10**9):\n    pass", False, {},
            torch.futures.Future())
    j.filename = "<worker1 cell 3>"
    return j


def test_a_held_capture_keeps_what_is_written_and_hands_it_on_in_order():
    cap = Capture("c1", "kernel_1", "worker1", "token")
    cap.hold()
    cap.write("stdout", "step 1\n")
    cap.flush()
    cap.write("stdout", "step 2\n")
    cap.write("stderr", "warning\n")
    kept, seq = cap.take()
    assert kept == [("stdout", "step 1\n"), ("stdout", "step 2\n"), ("stderr", "warning\n")]
    assert seq == 0  # nothing was sent: the adopter's first batch is number 0
    assert cap.take() == ([], 0)  # taken once
    cap.write("stdout", "step 3\n")
    cap.flush()
    assert cap.held == [("stdout", "step 3\n")]


def test_a_batch_that_cannot_be_sent_is_kept_not_dropped():
    # no RPC agent here: the send raises, as it does once the caller has left the group
    cap = Capture("c1", "kernel_1", "worker1", "token")
    cap.write("stdout", "lost before\n")
    cap.flush()
    assert cap.held == [("stdout", "lost before\n")] and cap.take() == (
        [("stdout", "lost before\n")], 0)


def test_a_long_run_keeps_the_last_part_of_its_output():
    cap = Capture("c1", "kernel_1", "worker1", "token")
    cap.hold()
    line = "x" * 999 + "\n"
    for i in range(3 * HELD_CHARS // 1000):
        cap.write("stdout", f"{i:08d}" + line)
        cap.flush()
    kept, _ = cap.take()
    size = sum(len(text) for _, text in kept)
    assert HELD_CHARS - 2000 < size <= HELD_CHARS
    assert kept[-1][1].startswith(f"{3 * HELD_CHARS // 1000 - 1:08d}")


def test_an_orphan_is_kept_until_adopted_and_its_result_handed_over():
    o = orphans.Orphans("worker1")
    running = job("c1")
    o.caller_gone("kernel_1", running, since=100.0)
    o.caller_gone("kernel_2", None, since=0.0)  # a member with no cell here
    assert list(o.cells) == ["c1"] and o.gone == {"kernel_1", "kernel_2"}
    result = CellResult("worker1", True, value="trained", has_value=True)
    o.ended("c1", True, "", result.wire())
    [rec] = o.adopt("kernel_3")
    assert rec["caller"] == "kernel_1" and rec["status"] == "done" and rec["since"] == 100.0
    assert rec["cell"] == "<worker1 cell 3>" and rec["ended"] is not None
    assert o.adopt("kernel_4") == []  # adopted already
    fut = o.result("c1", "kernel_3")
    assert fut.done() and fut.value()[2] == "trained"
    assert o.cells == {}  # handed over: nothing kept


def test_an_adopted_cell_still_running_gets_its_result_when_it_ends():
    o = orphans.Orphans("worker1")
    o.caller_gone("kernel_1", job("c1"), since=1.0)
    o.adopt("kernel_2")
    fut = o.result("c1", "kernel_2")
    assert not fut.done()
    o.ended("c1", False, "ZeroDivisionError", CellResult("worker1", False,
                                                          ename="ZeroDivisionError"))
    assert fut.done() and fut.value().ename == "ZeroDivisionError" and o.cells == {}


def test_the_adopter_going_too_leaves_the_cell_for_the_next_kernel():
    o = orphans.Orphans("worker1")
    o.caller_gone("kernel_1", job("c1"), since=1.0)
    o.adopt("kernel_2")
    o.result("c1", "kernel_2")
    o.caller_gone("kernel_2", None, since=0.0)
    [rec] = o.adopt("kernel_3")
    assert rec["call_id"] == "c1"
    try:
        o.result("c1", "kernel_2")
    except RuntimeError as exc:
        assert "keeps no cell c1 for this kernel" in str(exc)
    else:
        raise AssertionError("the kernel that went away still got the result")


def test_a_cell_queued_behind_is_an_orphan_from_its_start_and_few_ended_ones_are_kept():
    o = orphans.Orphans("worker1")
    o.caller_gone("kernel_1", None, since=0.0)
    from rpcnb.cells.output import router

    for i in range(orphans.KEEP_ENDED + 3):
        j = job(f"q{i}")
        router.enter((j.call_id, j.caller, "worker1", j.token), process_wide=False)
        try:
            o.starting(j)
        finally:
            router.leave(process_wide=False)
        o.ended(j.call_id, True, "", (0.0, 0))
    o.starting(job("other", caller="kernel_9"))  # a caller that is still there: not kept
    assert sorted(o.cells) == sorted(f"q{i}" for i in range(3, orphans.KEEP_ENDED + 3))
