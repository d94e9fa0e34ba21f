"""A remote cell's output (rpcnb.cells.output): sent in batches while the cell runs, all of
it delivered before the cell's result, in order, and a line rewritten with carriage
returns (a progress bar) sent as what a terminal would show, not as every write.

Real parts only: this test process is worker0 of a group with a real worker1 (conftest's
``api_group``), the batches travel over torch RPC. Where a test must catch a batch in the
middle of its send, the batch holds an object whose pickling waits for the test (the
``Gate``): the send is torch's own, held at a point the test chooses. The same over a slow,
lossy link, with 20 MB of text: tests/net/test_slow_links.py."""

from __future__ import annotations

import sys
import threading
from typing import Any

from conftest import wait_until

import rpcnb
from rpcnb.cells import output
from rpcnb.cells.printer import visible
from rpcnb.session import state

# -- a batch held in the middle of its send ------------------------------------------------

_ARRIVED: dict[int, threading.Event] = {}  # a gate's id -> set where its batch was read


def arrive(gate_id: int) -> str:
    """What a ``Gate`` unpickles as, where its batch arrives: marks the arrival."""
    _ARRIVED[gate_id].set()
    return "gate"


class Gate:
    """A value in a batch of output whose pickling (on the sending thread, inside torch's
    ``rpc_async``) says it began and then waits to be let through; where the batch arrives
    it unpickles as the string "gate" and marks the arrival."""

    def __init__(self) -> None:
        self.sending, self.through = threading.Event(), threading.Event()
        _ARRIVED[id(self)] = self.arrived = threading.Event()

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        self.sending.set()
        assert self.through.wait(60), "the test never let the batch through"
        return arrive, (id(self),)


def in_close_waiting(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside ``Capture.close`` taking what is left (its flush),
    where a close that waits for the batch on its way blocks."""
    frame = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
    while frame is not None:
        if frame.f_code.co_name == "flush" and frame.f_back is not None \
                and frame.f_back.f_code.co_name == "close":
            return True
        frame = frame.f_back
    return False


def test_close_waits_for_a_batch_another_thread_is_still_sending(api_group):
    s = state.active()
    assert s is not None
    # a capture sending to this process's own agent (worker0 to worker0, over torch RPC):
    # its arrival is seen here, the moment the receiving side reads it
    cap = output.Capture("call-held", s.name, s.name, s.token)
    cap.write("stdout", "0123456789abcdef\n" * 1000)
    gate = Gate()
    # a thread of the cell displays something while the cell ends: display() flushes at
    # once, on that thread, and its batch is held in the middle of its send
    shower = threading.Thread(target=cap.display, args=("display", {"data": {"x": gate}}))
    shower.start()
    assert gate.sending.wait(30), "the batch was never sent"
    seen: dict[str, Any] = {}

    def ends() -> None:  # what the cell's thread does when the cell ends
        seen["batches"] = cap.close()
        seen["arrived"] = gate.arrived.is_set()

    closer = threading.Thread(target=ends)
    closer.start()
    # a close() that does not wait for that batch returns now; one that does is blocked
    # taking what is left: either way, then the batch goes on
    assert wait_until(lambda: not closer.is_alive() or in_close_waiting(closer), timeout=30)
    gate.through.set()
    closer.join(60)
    shower.join(60)
    assert not closer.is_alive() and not shower.is_alive()
    assert seen["arrived"], "close() returned before the batch on its way had arrived"
    assert seen["batches"] == 1  # the text and the display went as one batch


# -- what the user sees: every line, in order, before the result ---------------------------

COUNTING = """\
import sys, threading, time
def count(first, last, stream):
    for i in range(first, last):
        print(f"line {i}", file=stream)
        if i % 50 == 0:
            time.sleep(0.01)  # the cell runs across several batches
count(0, 300, sys.stdout)
t = threading.Thread(target=count, args=(300, 400, sys.stdout))  # a thread of the cell
t.start(); t.join()
print("last words", end="")
'done'
"""


def test_every_line_arrives_in_order_before_the_result(api_group, capsys):
    for _ in range(5):  # each run its own batches
        assert rpcnb.run("worker1", COUNTING, fetch=True) == "done"
        shown = capsys.readouterr().out  # all of it there when the result came back
        assert shown == "".join(f"line {i}\n" for i in range(400)) + "last words", shown[-200:]


def test_stdout_and_stderr_each_keep_their_order(api_group, capsys):
    code = ("import sys\nfor i in range(200):\n"
            "    print(f'out {i}', flush=True)\n"
            "    print(f'err {i}', file=sys.stderr, flush=True)\n")
    rpcnb.run("worker1", code)
    shown = capsys.readouterr()
    assert shown.out == "".join(f"out {i}\n" for i in range(200))
    assert shown.err == "".join(f"err {i}\n" for i in range(200))


# -- a progress bar: what a terminal would show, not every write ---------------------------

BAR = """\
import sys, time
for i in range(20001):
    sys.stdout.write(f"\\rstep {i}")
    if i % 2000 == 0:
        time.sleep(0.02)  # several batches
sys.stdout.write("\\n")
print("after the bar")
"""


def test_a_progress_bar_arrives_as_what_a_terminal_shows(api_group, capsys):
    rpcnb.run("worker1", BAR)
    shown = capsys.readouterr().out
    bar, after = shown.split("\n")[:2]
    assert visible(bar) == "step 20000"  # the bar's last state, as a terminal shows it
    assert after == "after the bar" and shown.endswith("after the bar\n")
    # a rewritten line travels as its last version per batch: a handful, not 20001
    assert 1 <= bar.count("\r") <= 1000, bar.count("\r")
    versions = [v for v in bar.split("\r") if v]
    steps = [int(v.split()[1]) for v in versions]
    assert steps == sorted(steps) and steps[-1] == 20000  # the versions kept, in order
