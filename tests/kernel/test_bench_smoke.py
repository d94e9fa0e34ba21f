"""`make bench` at tiny sizes (``bench.run --smoke``: each comparison of a quick run once, at
the smallest counts that still give every figure; the UCX section, a process of its own
whose output is not read here, left out): every comparison runs, side by side, and leaves
nothing. Timings are not asserted here (that is what bench/ reports), so the test need not
run alone: only that each figure was measured, the JSON has what docs/benchmarks.md's
generated part needs, and every process and buffer it made is gone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402


def test_smoke_benchmark_runs_every_comparison(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["mode"] == "smoke" and not data["errors"]
    results = data["results"]
    for key in ("roundtrip", "transfer", "fanout", "startup", "startup_cold_warm", "curves",
                "idle", "notebook_code", "overhead"):
        assert results.get(key), f"no {key} figures"
    sizes = results["curves"]["one_way"]["sizes"]
    for entry in sizes.values():  # every path measured at every size, every sample kept
        assert all(entry["samples_ms"][p] for p in ("tensorpipe", "rpcnb shm", "zero-copy", "memcpy"))
    assert all(entry["taken"]["zero-copy"] == len(entry["samples_ms"]["zero-copy"])
               for entry in sizes.values()), "every share_memory_() send went by handle"
    assert results["idle"]["processes"] and results["idle"]["pct_of_one_core"] >= 0
    assert data["left_processes"] == [] and data["leftover_shm"] == []
    assert data["targets"], "the issue's targets are reported next to the figures"
    assert "tensorpipe" in data["table"] and "memcpy" in data["table"]
    assert any(t["target"].startswith("idle group") for t in data["targets"])
    assert any(t["target"].startswith("pasted batched RL") for t in data["targets"])
    overhead = {r["call"]: r for r in results["overhead"]["rows"]}
    assert overhead["rpc_sync python fn"]["torch_ms"] > 0 and overhead["rpc_sync python fn"]["rpcnb_ms"] > 0
    assert any(t["target"].startswith("rpc_sync python fn <=") for t in data["targets"])
    # how far the ratio moved between turns (torch first, then rpcnb first: ABBA)
    lo, mid, hi = overhead["rpc_sync python fn"]["turn_ratios"]
    assert 0 < lo <= mid <= hi
    # push+fetch takes turns with the memcpy it is compared with: each turn's ratio is kept
    lo, mid, hi = overhead["push+fetch 100 MB"]["turn_ratios"]
    assert 0 < lo <= mid <= hi
    # the no-op cell timed call by call against a raw rpc_sync in its own group
    paired = [overhead[f"{row}, paired"]["rpcnb_ms"] for row in ("rpc_sync python fn",
                                                                 "rpcnb.run no-op")]
    assert all(ms > 0 for ms in paired)
    assert any(t["target"].startswith("rpcnb.run no-op, paired <=") for t in data["targets"])

    # the docs' generated block and figures, from that JSON
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(f"# Page\n\nbefore\n\n{report.BEGIN}\nold\n{report.END}\n\nafter\n")
    figures = tmp_path / "docs" / "_static" / "bench"
    proc = subprocess.run([sys.executable, "-m", "bench.report", str(out), "--doc", str(page),
                           "--figures", str(figures)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = page.read_text()
    assert text.startswith("# Page\n\nbefore\n") and text.endswith("after\n") and "\nold\n" not in text
    for name in ("oneway", "init", "fanout"):
        png = figures / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"](_static/bench/{name}.png)" in text
    assert "zero-copy ms" in text and f"Idle group of {results['idle']['workers']} workers" in text
    for t in data["targets"]:  # the page's targets are the JSON's
        assert t["target"] in text
