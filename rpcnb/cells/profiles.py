"""``%%remote --profile``: a cell run under ``torch.profiler`` where it is sent
(``profiled``), and its profiles shown and kept on the caller's host (``show``): each
worker's top operators, printed, and its Chrome / Perfetto trace, written under
``folder()``.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

from rpcnb import settings

PROFILE_ROWS = 12  # operators in a --profile table


def profiled(run: Any) -> tuple[Any, dict[str, Any]]:
    """``run()`` under ``torch.profiler`` (the CPU, and CUDA where there is one): its
    result, and the profile: the top operators by self time, as a table, and the Chrome /
    Perfetto trace's bytes (sent back to the caller, which keeps the file)."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        result = run()
    sort = "self_cuda_time_total" if ProfilerActivity.CUDA in acts else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=PROFILE_ROWS)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = open(f.name, "rb").read()
    return result, {"table": table, "trace": trace, "cuda": ProfilerActivity.CUDA in acts}


PROFILES = "rpcnb-profiles"  # under the working directory, unless RPCNB_PROFILE_DIR says
_profiled = itertools.count(1)


def folder() -> Path:
    """Where ``--profile`` writes its traces (``$RPCNB_PROFILE_DIR``, else
    ``./rpcnb-profiles``)."""
    return Path(settings.text("RPCNB_PROFILE_DIR") or PROFILES).absolute()


def show(found: dict[str, dict[str, Any]]) -> list[Path]:
    """Print each worker's top operators and write its trace (``found``: worker -> the
    profile its cell's result carried); with several workers, also one trace of them all
    (each worker a process of its own on one timeline). The paths."""
    if not found:
        return []
    where = folder() / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_profiled)}"
    where.mkdir(parents=True, exist_ok=True)
    paths, events = [], []
    for worker, prof in sorted(found.items()):
        path = where / f"{worker}.json"
        path.write_bytes(prof["trace"])
        paths.append(path)
        try:
            trace = json.loads(prof["trace"])
            for ev in trace.get("traceEvents", []):
                if ev.get("ph") == "M" and ev.get("name") == "process_name":
                    ev.setdefault("args", {})["name"] = worker
            events.append((worker, trace))
        except ValueError:
            pass
        print(f"[{worker}] top operators ({'CUDA' if prof.get('cuda') else 'CPU'} self "
              f"time):\n{prof['table'].rstrip()}\n[{worker}] trace: {path}")
    if len(events) > 1:
        merged = {"traceEvents": [ev for _, t in events for ev in t.get("traceEvents", [])],
                  "displayTimeUnit": "ms"}
        both = where / "all.json"
        both.write_text(json.dumps(merged))
        paths.append(both)
        print(f"all workers on one timeline: {both} (open it in https://ui.perfetto.dev or "
              "chrome://tracing)")
    return paths
