"""%%remote --profile: the cell runs under torch.profiler on each worker; the notebook shows
each worker's top operators and the path of its trace on the kernel's host, and, with
several workers, one trace with all of them on one timeline."""

from __future__ import annotations

import json
import re
from pathlib import Path

CELL = ("import torch\nx = torch.randn(200, 200)\nfor _ in range(20):\n    y = x @ x\n"
        "float(y.sum()) != 0")


def test_profile_shows_top_operators_and_writes_traces(group, tmp_path):
    group.execute(f"import os\nos.environ['RPCNB_PROFILE_DIR'] = {str(tmp_path)!r}")
    out = group.execute("%%remote --all --profile --fetch\n" + CELL, timeout=120)
    assert out.text == "{'worker1': True, 'worker2': True}"  # the cell's value, as ever
    for w in ("worker1", "worker2"):
        assert f"[{w}] top operators (CPU self time):" in out.stdout, out.stdout
    table = out.stdout.split("[worker1] top operators", 1)[1].split("[worker1] trace:", 1)[0]
    assert "aten::mm" in table and "Self CPU" in table  # the matmul is what took the time
    traces = dict(re.findall(r"\[(worker\d)\] trace: (\S+)", out.stdout))
    assert sorted(traces) == ["worker1", "worker2"]
    for path in traces.values():
        p = Path(path)
        assert p.is_file() and p.is_relative_to(tmp_path), path
        names = {ev.get("name") for ev in json.loads(p.read_text())["traceEvents"]}
        assert "aten::mm" in names
    both = re.search(r"all workers on one timeline: (\S+)", out.stdout)
    assert both, out.stdout
    merged = json.loads(Path(both.group(1)).read_text())["traceEvents"]
    shown = {ev["args"]["name"] for ev in merged
             if ev.get("ph") == "M" and ev.get("name") == "process_name"}
    assert {"worker1", "worker2"} <= shown  # two processes, named, on one timeline
    pids = {ev.get("pid") for ev in merged if ev.get("name") == "aten::mm"}
    assert len(pids) == 2


def test_profile_with_bg_is_refused(group):
    out = group.execute("%%remote worker1 --bg --profile\n1", allow_error=True)
    assert "--profile shows its tables when the cell ends" in out.stderr
