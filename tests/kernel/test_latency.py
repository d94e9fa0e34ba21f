"""Latency that means latency: a cell whose code runs for a second is not a 1,000 ms
spike in the monitor, the panel or %rpc_workers; the time its code ran is kept apart."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.serial  # it measures latency: alone on the machine


def test_a_long_cell_is_not_a_latency_spike(group):
    group.execute("%%remote worker1\nimport time\ntime.sleep(1.5)")
    rec = group.value("[(r['duration'], r['ran']) for r in __import__('rpcnb').telemetry"
                      ".records('worker1') if r['op'] == 'cell'][-1]")
    duration, ran = rec
    assert duration >= 1.5 and 1.45 <= ran <= duration  # the code's time, kept apart
    assert duration - ran < 0.5  # what is left is transit and rpcnb
    recent = group.value("__import__('rpcnb').telemetry.summary('worker1')['recent_ms']")
    assert recent < 500, recent  # %rpc_workers' and the panel's "recent"
    series = group.value(
        "[p[1] for p in __import__('rpcnb.observe.traffic', fromlist=['x']).Traffic("
        "__import__('rpcnb.session.state', fromlist=['x']).current())"
        ".picture(remote=False).series['worker1']]")
    assert series and max(series) < 500, series  # the monitor's latency over time
