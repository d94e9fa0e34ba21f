"""Idle cost (issue 14, item 3): the CPU time an idle group of 4 workers plus its kernel
uses over 30 s (``--quick``: 5 s), from /proc/<pid>/stat (user + system ticks) of the
kernel and every process it started, per process. Target: under 2% of one core in total.

A bench module for ``bench.run`` / ``bench.report`` (see ``bench.curves`` for the protocol).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

SECTION = "idle"
WORKERS = 4
LIMIT_PCT = 2.0


def cpu_ticks(pid: int) -> tuple[str, int] | None:
    """(command name, user + system clock ticks) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return name, int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)


def measure(ctx: Any) -> dict[str, Any]:
    own = ctx.cfg.get(SECTION, {})  # bench.run's SMOKE
    seconds = own.get("seconds", 5.0 if ctx.quick else 30.0)
    workers = own.get("workers", WORKERS)
    ctx.log(f"idle: a group of {workers} workers and its kernel, doing nothing for {seconds:g} s")
    k = ctx.new_kernel()
    try:
        ctx.cell(k, "%load_ext rpcnb")
        ctx.cell(k, f"%rpc_init --workers {workers} {ctx.rpc_args}".strip(), timeout=300)
        ctx.cell(k, "%%remote --all\nNone")  # every worker has run a cell
        time.sleep(2.0)  # start-up's last work (threads spinning down) is not idle time
        pids = [k.pid] + ctx.children_of(k.pid)
        before = {p: cpu_ticks(p) for p in pids}
        t0 = time.monotonic()
        time.sleep(seconds)
        wall = time.monotonic() - t0
        after = {p: cpu_ticks(p) for p in pids}
    finally:
        ctx.close_kernel(k, ["B.stop_rpcnb()"])
    hz = os.sysconf("SC_CLK_TCK")
    procs = []
    for p in pids:
        b, a = before.get(p), after.get(p)
        if b is None or a is None:
            continue
        procs.append({"pid": p, "name": a[0], "cpu_s": (a[1] - b[1]) / hz,
                      "kernel": p == k.pid})
    total = sum(x["cpu_s"] for x in procs)
    return {"seconds": round(wall, 3), "workers": workers, "clk_tck": hz, "processes": procs,
            "cpu_s": total, "pct_of_one_core": 100.0 * total / wall}


def report(section: dict[str, Any], results: dict[str, Any]) -> Any:
    from bench.report import Part, target

    part = Part(title="Idle cost")
    rows = [["idle process", "pid", "CPU s", "% of one core"]]
    wall = section["seconds"]
    for p in section["processes"]:
        label = "kernel (worker0)" if p["kernel"] else p["name"]
        rows.append([label, str(p["pid"]), f"{p['cpu_s']:.2f}", f"{100 * p['cpu_s'] / wall:.2f}"])
    rows.append(["total", "", f"{section['cpu_s']:.2f}", f"{section['pct_of_one_core']:.2f}"])
    part.tables.append((f"Idle group of {section['workers']} workers plus its kernel, "
                        f"{wall:.0f} s (/proc user+system, {section['clk_tck']} ticks/s)", rows))
    pct = section["pct_of_one_core"]
    part.targets.append(target(f"idle group of {section['workers']} workers + kernel < "
                               f"{LIMIT_PCT:g}% of one core", pct, LIMIT_PCT, pct < LIMIT_PCT,
                               f"{pct:.2f}% ({section['cpu_s']:.2f} CPU s in {wall:.0f} s)"))
    return part
