"""Records made while no one listens wait as their fields (rpcnb.telemetry.record) and
read back the same as the others: in order, counted, bounded, and told to a listener
once one subscribes. Real threads write them concurrently."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rpcnb import telemetry


@pytest.fixture(autouse=True)
def fresh():
    telemetry.clear()
    yield
    telemetry.clear()


def test_records_made_with_no_listener_read_back_in_order_and_counted():
    for i in range(5):
        telemetry.record("w1", "cell", float(i), 0.001 * (i + 1), ran=0.0005)
    telemetry.count("w1")  # a call counted, not timed
    recs = telemetry.records("w1")
    assert [r["start"] for r in recs] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert recs[2]["duration"] == pytest.approx(0.003) and recs[2]["ran"] == 0.0005
    summary = telemetry.summary("w1")
    assert summary["calls"] == 6
    assert summary["p50_ms"] == pytest.approx(2.5)  # latency: the duration without ``ran``


def test_a_listener_hears_new_records_and_the_order_stays_with_the_ones_that_waited():
    telemetry.record("w1", "cell", 1.0, 0.001)
    heard: list[Any] = []
    telemetry.subscribe(heard.append)
    try:
        telemetry.record("w1", "cell", 2.0, 0.001)
    finally:
        telemetry.unsubscribe(heard.append)
    telemetry.record("w1", "cell", 3.0, 0.001)
    assert [r.start for r in heard] == [2.0]
    assert [r["start"] for r in telemetry.records()] == [1.0, 2.0, 3.0]


def test_waiting_records_stay_bounded_and_the_newest_are_kept():
    n = telemetry.CAPACITY * 2 + 7
    for i in range(n):
        telemetry.record("w1", "cell", float(i), 0.001)
    assert len(telemetry.CALLS.later) < telemetry.LATER  # settled a few hundred at a time
    recs = telemetry.records()
    assert len(recs) == telemetry.CAPACITY and recs[-1]["start"] == float(n - 1)
    assert telemetry.summary("w1")["calls"] == n


def test_records_from_many_threads_while_another_reads_are_all_counted():
    per, threads = 2000, 4
    stop = threading.Event()

    def write(k: int) -> None:
        for i in range(per):
            telemetry.record(f"w{k}", "cell", float(i), 0.001)

    def read() -> None:
        while not stop.is_set():
            telemetry.summary("w0")
            telemetry.records("w1")

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(k,)) for k in range(threads)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert [telemetry.summary(f"w{k}")["calls"] for k in range(threads)] == [per] * threads
    for k in range(threads):  # each writer's records in the order it made them
        starts = [r["start"] for r in telemetry.records(f"w{k}")]
        assert starts == sorted(starts) and len(starts) == per
