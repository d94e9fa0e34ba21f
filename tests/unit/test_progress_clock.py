"""A large transfer's ticker (rpcnb.progress.Ticker): its bar shows only once the transfer
has taken RPCNB_PROGRESS_DELAY seconds, then says the rate; tickers share one thread."""

from __future__ import annotations

import threading
import time

from rpcnb import progress


def test_a_quick_transfer_shows_nothing_and_starts_no_thread_each(monkeypatch, capsys):
    monkeypatch.setenv(progress.DELAY_ENV, "0.5")
    progress.Ticker("--push to worker1:", 100 << 20).done()  # the clock's thread, once
    before = threading.active_count()
    for _ in range(20):
        progress.Ticker("--push to worker1:", 100 << 20).done()
    assert threading.active_count() == before
    assert "--push" not in capsys.readouterr().out


def test_a_slow_transfer_shows_its_bar_after_the_delay_then_its_rate(monkeypatch, capsys):
    monkeypatch.setenv(progress.DELAY_ENV, "0.2")
    quick = progress.Ticker("--fetch from worker2:", 8 << 20)
    slow = progress.Ticker("--push to worker1:", 100 << 20)
    quick.done()
    time.sleep(0.1)
    assert "--push" not in capsys.readouterr().out  # not yet due
    deadline = time.monotonic() + 5
    while slow.line is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert slow.line is not None, "the bar did not show after its delay"
    slow.done()
    out = capsys.readouterr().out
    assert "--push to worker1: 100.0 MB [" in out, out
    assert out.rstrip().endswith("/s"), out  # the last line says the rate
    assert "--fetch" not in out  # the quick one ended before it was due


def test_a_transfer_that_fails_says_stopped(monkeypatch, capsys):
    monkeypatch.setenv(progress.DELAY_ENV, "0")
    progress.Ticker("--push to worker1:", 100 << 20).done(ok=False)
    assert "--push to worker1: 100.0 MB: stopped" in capsys.readouterr().out
