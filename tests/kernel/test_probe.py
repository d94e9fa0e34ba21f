"""%rpc_probe in a real kernel with real workers: latency and bandwidth per peer and size,
a progress bar while it runs, the results kept in telemetry."""

from __future__ import annotations

from rpcnb.observe import probe
from rpcnb.observe.channels import NOT_IN_GROUP


def test_probe_measures_every_peer_and_keeps_results(group):
    out = group.execute("%rpc_probe --sizes 1K,64K,2M --repeats 2")
    text = out.text
    for peer in ("worker1", "worker2"):
        assert peer in text
    for size in ("1 KB", "64 KB", "2 MB", "empty call"):
        assert size in text
    assert "cma" in text and "rpcnb_shm" in text  # small ones on TensorPipe, 2 MB on shm
    # a progress bar (an ipywidgets view) was shown while it ran
    assert any("application/vnd.jupyter.widget-view+json" in d["data"] for d in out.displays)
    kept = group.value(
        "[(r['peer'], r['nbytes'], r['channel'], r['duration'] > 0) "
        "for r in __import__('rpcnb.observe.probe').observe.probe.probe_records()]")
    assert len(kept) == 2 * 4
    assert all(ok for *_, ok in kept)
    assert {(peer, n) for peer, n, _, _ in kept} == {
        (p, n) for p in ("worker1", "worker2") for n in (0, 1024, 65536, 2 << 20)}
    results = group.value("_.to_dict()")
    point = results["peers"][0]["points"][-1]
    assert point["nbytes"] == 2 << 20 and point["bytes_per_s"] > 0 and point["ms"] > 0


def test_probe_one_worker_on_tensorpipe_only(group):
    out = group.execute("%rpc_probe worker2 --tensorpipe --sizes 4M --repeats 1")
    assert "worker2" in out.text and "worker1" not in out.text
    assert "4 MB" in out.text and "rpcnb_shm" not in out.text and "cma" in out.text


def test_probe_bad_input(group):
    out = group.execute("%rpc_probe worker9", allow_error=True)
    assert NOT_IN_GROUP.split("{")[0] in out.traceback or "is not a member" in out.traceback
    out = group.execute("%rpc_probe --sizes 12Q", allow_error=True)
    assert probe.BAD_SIZE.format(text="12Q") in out.traceback
    out = group.execute("%rpc_probe worker0", allow_error=True)
    assert probe.SELF_PROBE.format(name="worker0") in out.traceback


def test_probe_needs_a_group(rpcnb_kernel):
    out = rpcnb_kernel.execute("%rpc_probe", allow_error=True)
    assert "run %rpc_init" in out.traceback
