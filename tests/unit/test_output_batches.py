"""A remote cell's output batches (rpcnb.cells.output.Capture): the cell's result is sent
only once every batch of its output has been delivered.

The delivery here is a real torch Future completed from another thread; what is replaced
is only the sending (``protocol.call_async``), made slow on purpose, because the race it
shows needs a flush caught between taking a batch and registering its delivery. The real
path (a 20 MB printout over a slow link) is tests/net/test_slow_links.py.
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from rpcnb.cells import output  # noqa: E402
from rpcnb.session import protocol  # noqa: E402


def test_close_waits_for_a_batch_the_flusher_is_still_sending(monkeypatch):
    delivered = threading.Event()
    started = threading.Event()

    def slow_send(token, to, op, *args, timeout=None, nbytes=0):
        started.set()
        time.sleep(0.3)  # pickling 20 MB of text takes this long on a slow machine
        fut = torch.futures.Future()

        def arrive():
            time.sleep(0.3)  # the bytes on their way to the caller
            delivered.set()
            fut.set_result(None)

        threading.Thread(target=arrive, daemon=True).start()
        return fut

    monkeypatch.setattr(protocol, "call_async", slow_send)
    cap = output.Capture("call-1", "caller", "worker2", "token")
    cap.write("stdout", "0123456789abcdef\n" * 1000)
    flusher = threading.Thread(target=cap.flush)  # what the flusher thread does
    flusher.start()
    assert started.wait(5)
    batches = cap.close()  # what the cell's thread does when the cell ends
    assert delivered.is_set(), "close() returned before the output's delivery arrived"
    assert batches == 1
    flusher.join(5)


def test_batches_keep_their_order_and_close_counts_them(monkeypatch):
    sent: list[tuple[int, list]] = []

    def send(token, to, op, call_id, worker, seq, items, timeout=None, nbytes=0):
        sent.append((seq, items))
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut

    monkeypatch.setattr(protocol, "call_async", send)
    cap = output.Capture("call-1", "caller", "worker2", "token")
    cap.write("stdout", "a\n")
    cap.flush()
    cap.write("stdout", "b\r")
    cap.write("stdout", "c\r")  # a progress bar: only its last version goes
    cap.write("stderr", "d\n")
    assert cap.close() == 2
    assert sent == [(0, [("stdout", "a\n")]), (1, [("stdout", "\rc\r"), ("stderr", "d\n")])]
