"""`make bench` at tiny sizes: every comparison runs, side by side, and leaves nothing.
Timings are not asserted here (that is what bench/ reports); only that each figure was
measured and every process and buffer it made is gone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_benchmark_runs_every_comparison(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert not data["errors"]
    results = data["results"]
    for key in ("roundtrip", "transfer", "fanout", "startup", "startup_cold_warm"):
        assert results.get(key), f"no {key} figures"
    assert data["left_processes"] == [] and data["leftover_shm"] == []
    assert data["targets"], "the issue's targets are reported next to the figures"
    assert "tensorpipe" in data["table"] and "memcpy" in data["table"]
