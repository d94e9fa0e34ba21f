"""Which threads belong to a running cell in a worker process (rpcnb.cells.output): the
threads it starts are its own, those that existed when it began are not (their output
goes to the process's background capture), even where a new thread reuses the ident of
one that ended."""

from __future__ import annotations

import threading

import pytest

from rpcnb.cells import output


def _run_thread(target=lambda: None) -> threading.Thread:
    t = threading.Thread(target=target)
    t.start()
    t.join()
    return t


def test_threads_seen_as_a_cell_begins_are_told_from_later_ones():
    stop = threading.Event()
    older = threading.Thread(target=stop.wait)
    older.start()
    try:
        seen = output._Threads()
        assert threading.current_thread() in seen
        assert older in seen
        later = threading.Thread(target=stop.wait)
        later.start()
        try:
            assert later not in seen
        finally:
            stop.set()
            later.join()
    finally:
        stop.set()
        older.join()


def test_a_reused_ident_is_not_taken_for_the_thread_that_had_it():
    stop = threading.Event()
    older = threading.Thread(target=stop.wait)
    older.start()
    seen = output._Threads()
    ident = older.ident
    stop.set()
    older.join()
    for _ in range(200):  # glibc hands an ended thread's stack, and so its ident, to the next
        t = _run_thread()
        if t.ident == ident:
            break
    else:
        pytest.skip("this C library gave no new thread the ident of an ended one")
    assert t not in seen


def test_a_silent_cell_makes_no_capture_and_its_threads_share_the_one_made():
    router = output._Router()
    router.enter(("cell-1", "worker0", "worker1", "token"), process_wide=True)
    assert router.leave(process_wide=True) is None  # nothing wrote: nothing made
    assert router.cell is None and not router.active

    router.enter(("cell-2", "worker0", "worker1", "token"), process_wide=True)
    heard: list[output.Capture | None] = []
    _run_thread(lambda: heard.append(router.current()))  # a thread the cell started
    cap = router.current()  # the cell's own thread: the same capture
    assert heard == [cap] and cap is not None and cap.call_id == "cell-2"
    assert router.leave(process_wide=True) is cap
    assert router.cell is None and not router.active


def test_a_cell_cut_short_before_its_leave_does_not_take_the_next_cells_output():
    # an interrupt that lands between a cell's first write and its leave: the next cell
    # gets a capture of its own, and nothing of the first stays registered for the flusher
    router = output._Router()
    router.enter(("cell-1", "worker0", "worker1", "token"), process_wide=True)
    first = router.current()
    router.enter(("cell-2", "worker0", "worker1", "token"), process_wide=True)
    second = router.current()
    assert first is not None and second is not None and second is not first
    assert second.call_id == "cell-2" and list(router.active.values()) == [second]
    assert router.leave(process_wide=True) is second


def test_a_thread_of_an_ended_cell_never_writes_into_the_next_cells_capture():
    router = output._Router()
    stop, go = threading.Event(), threading.Event()
    heard: list[output.Capture | None] = []

    def late():  # started by cell 1, writes once cell 2 runs
        go.wait()
        heard.append(router.current())
        stop.set()

    router.enter(("cell-1", "worker0", "worker1", "token"), process_wide=True)
    t = threading.Thread(target=late)
    t.start()
    router.leave(process_wide=True)
    router.enter(("cell-2", "worker0", "worker1", "token"), process_wide=True)
    go.set()
    stop.wait(5)
    t.join()
    # it is older than cell 2: the background (None in a process without one)
    assert heard == [router.background]
    assert router.leave(process_wide=True) is None
