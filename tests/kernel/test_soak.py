"""A long working day, compressed: thousands of remote cells, RRefs created and dropped,
large pushes and fetches, output floods, and many init/shutdown cycles in one kernel. After
each kind of work the kernel and its workers must not have grown per unit of work (resident
memory, file descriptors, threads, /dev/shm), and the group must still answer.

``make test`` runs it with small counts (about a minute); ``make soak`` with the issue's
full counts (``RPCNB_SOAK=full``), and writes the figures to bench/results/soak.json
(docs/load.md shows them). Each phase is measured twice, after a quarter of its work and at
its end: what grows between the two is what the work leaks; the first quarter pays for
warm-up (caches, pools, imports)."""

from __future__ import annotations

import ast
import json
import os
import time
from pathlib import Path

import pytest
from conftest import Kernel, wait_until, worker_pids

from rpcnb.paths import shm

pytestmark = pytest.mark.soak

FULL = os.environ.get("RPCNB_SOAK", "") == "full"
COUNTS = {  # the full counts, and the small ones make test runs
    "cells": 2000 if FULL else 200,
    "rrefs": 20000 if FULL else 2000,
    "pushes": 200 if FULL else 12,
    "push_mb": 64 if FULL else 16,
    "lines": 200_000 if FULL else 20_000,
    "line_mb": 20 if FULL else 2,
    "cycles": 50 if FULL else 5,
}
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "soak.json"
MB = 1 << 20

# How much a unit of work may leave behind, at most (measured growth between the quarter
# and the end of a phase, divided by the work done in between).
BOUNDS = {
    "cells": {"rss": 20 << 10, "fds": 0.01, "threads": 0.01},  # per cell
    "rrefs": {"rss": 2 << 10, "fds": 0.001, "threads": 0.001},  # per RRef
    "pushes": {"rss": 4 * MB, "fds": 0.1, "threads": 0.1},  # per push + fetch
    "floods": {"rss": 4 * MB, "fds": 0.5, "threads": 0.5},  # per flood, beyond a plain print
    "cycles": {"rss": 8 * MB, "fds": 1.0, "threads": 0.5},  # per init/shutdown
}
# What a phase may grow by in all, beside its per-unit bound: a connection or pool file
# opened lazily once in the second part (seen once in CI: the kernel +2 fds over 1,500
# RRefs). A leak of one per unit is hundreds, far past it. Phases of few units (the
# init/shutdown cycles) get none.
SLACK = {"rss": 0, "fds": 4, "threads": 2}
SLACK_FROM = 100  # units


def footprint(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Threads:")))
    rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": threads}


def group_footprint(k: Kernel) -> dict[str, dict[str, int]]:
    pids = worker_pids(k)
    found = {name: footprint(pid) for name, pid in pids.items()}
    # this group's buffers only: another group on the machine (a test running beside this
    # one) has its own
    group = k.value("__import__('rpcnb.session.state').session.state.current().group_id")
    left = shm.leftovers(group)
    found["shm"] = {"files": len(left), "bytes": sum(os.path.getsize(p) for p in left)}
    return found


IDLE = ("from rpcnb.paths import shm as _shm\n"
        "_stats = _shm.stats()\n_stats['buffers'] - _stats['in_flight']")


def idle_buffers(k: Kernel) -> int:
    """Shared-memory pool buffers that no message holds, on every member together."""
    here = k.value("shm.stats()['buffers'] - shm.stats()['in_flight']")
    there = k.execute(f"%%remote --all --fetch\n{IDLE}").text
    return here + sum(ast.literal_eval(there).values())


def growth(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]], units: int
           ) -> dict[str, dict[str, float]]:
    return {name: {key: (b[name][key] - a[name][key]) / units for key in ("rss", "fds", "threads")}
            for name in a if name != "shm"}


def check(phase: str, per_unit: dict[str, dict[str, float]], units: int) -> None:
    for member, grew in per_unit.items():
        for key, limit in BOUNDS[phase].items():
            slack = SLACK[key] if units >= SLACK_FROM else 0
            assert grew[key] * units <= limit * units + slack, (
                f"{phase}: {member} grew {grew[key]:.4g} {key} per unit over {units} units "
                f"(limit {limit:.4g} per unit + {slack})")


@pytest.fixture(scope="module")
def soaked():
    """One kernel, one group of two workers, each phase's figures."""
    k = Kernel()
    figures: dict[str, object] = {"counts": COUNTS}
    try:
        k.execute("import os\nos.environ['RPCNB_SHM_IDLE_S'] = '1'\n"
                  "%load_ext rpcnb\n%rpc_init --workers 2\n"
                  "import rpcnb, torch, torch.distributed.rpc as rpc\n"
                  "from rpcnb.paths import shm\n"
                  "def make(i):\n    return [i] * 8\n")
        yield k, figures
    finally:
        try:
            k.execute("%rpc_shutdown", timeout=60)
        except Exception:
            pass
        k.close()
        if FULL:
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(figures, indent=1))


def phase(k: Kernel, figures: dict, name: str, run: str, total: int) -> None:
    """Run ``run`` (a cell with ``{n}``) for a quarter of ``total``, measure, run the rest,
    measure; check and keep the growth per unit between the two."""
    quarter = max(1, total // 4)
    t0 = time.monotonic()
    k.execute(run.format(n=quarter), timeout=3600)
    mid = group_footprint(k)
    k.execute(run.format(n=total - quarter), timeout=3600)
    # idle: every member gives back the pool buffers nothing holds (after 1 s here)
    assert wait_until(lambda: idle_buffers(k) == 0, timeout=30), idle_buffers(k)
    end = group_footprint(k)
    per_unit = growth(mid, end, total - quarter)
    figures[name] = {"units": total, "seconds": round(time.monotonic() - t0, 1),
                     "middle": mid, "end": end, "growth_per_unit": per_unit}
    check(name, per_unit, total - quarter)
    assert end["shm"]["files"] == 0, f"{name}: /dev/shm holds {end['shm']} after idling"
    assert k.execute("%%remote --all --fetch\n6 * 7").text == "{'worker1': 42, 'worker2': 42}"


def test_thousands_of_cells(soaked):
    k, figures = soaked
    phase(k, figures, "cells", "for i in range({n}):\n"
          "    get_ipython().run_cell_magic('remote', 'worker1', 'x = 1\\nx + 1')\n",
          COUNTS["cells"])


def test_rrefs_created_and_dropped(soaked):
    k, figures = soaked
    phase(k, figures, "rrefs",
          "for i in range({n}):\n"
          "    r = rpc.remote('worker1', make, args=(i,))\n"
          "    assert r.to_here()[0] == i\n"
          "    del r\n", COUNTS["rrefs"])
    owned = k.execute("%%remote worker1 --fetch\n"
                      "from torch.distributed.rpc import _get_debug_info\n"
                      "int(_get_debug_info()['num_owner_rrefs'])")
    assert int(owned.text) < 50  # the dropped ones are deleted on their owner too


def test_large_pushes_and_fetches(soaked):
    k, figures = soaked
    mb = COUNTS["push_mb"]
    phase(k, figures, "pushes",
          f"t = torch.ones({mb * MB // 4})\n"
          "for i in range({n}):\n"
          "    assert rpcnb.run('worker1', 't.sum().item()', push={{'t': t}}, fetch=True) == t.numel()\n"
          "    back = rpcnb.run('worker2', 'import torch\\ntorch.ones(%d)' % t.numel(), fetch=True)\n"
          "    assert back.numel() == t.numel()\n"
          "del t, back\nrpcnb.run('worker1', 'del t')  # the pushed copy lives on worker1\n",
          COUNTS["pushes"])


def test_output_floods(soaked):
    k, figures = soaked
    lines, line_mb = COUNTS["lines"], COUNTS["line_mb"]
    out = k.execute(f"%%remote worker1\nfor i in range({lines}):\n    print('line', i)",
                    timeout=600)
    assert out.stdout.count("\n") == lines and out.stdout.endswith(f"line {lines - 1}\n")
    out = k.execute(f"%%remote worker1\nprint('x' * ({line_mb} << 20))", timeout=600)
    assert len(out.stdout) == (line_mb << 20) + 1
    # ipykernel itself keeps about what a cell prints (a plain print of the same line, in
    # this kernel, measured the same way): a remote flood may cost that, and little more
    before = footprint(k.pid)["rss"]
    for _ in range(4):
        k.execute(f"print('x' * ({line_mb} << 20))", timeout=600)
    plain = (footprint(k.pid)["rss"] - before) / 4
    figures["plain_print_rss_per_line"] = plain
    BOUNDS["floods"]["rss"] = max(plain, 0) + 4 * MB
    phase(k, figures, "floods",
          "for i in range({n}):\n"
          f"    get_ipython().run_cell_magic('remote', 'worker1', \"print('x' * ({line_mb} << 20))\")\n",
          4)


def test_init_shutdown_cycles(soaked):
    k, figures = soaked
    quarter = max(1, COUNTS["cycles"] // 4)
    kernel_only = {}

    def cycles(n: int) -> None:
        k.execute(f"for _ in range({n}):\n    rpcnb.shutdown()\n    rpcnb.init(2)\n", timeout=1800)

    t0 = time.monotonic()
    cycles(quarter)
    kernel_only["middle"] = {"worker0": footprint(k.pid)}
    cycles(COUNTS["cycles"] - quarter)
    # the last group's threads have started and the earlier ones' have ended: as many as
    # after the first cycles (a leak never gets there, and the check below says by how much)
    wait_until(lambda: footprint(k.pid)["threads"] <= kernel_only["middle"]["worker0"]["threads"])
    kernel_only["end"] = {"worker0": footprint(k.pid)}
    per_unit = growth(kernel_only["middle"], kernel_only["end"], COUNTS["cycles"] - quarter)
    figures["cycles"] = {"units": COUNTS["cycles"], "seconds": round(time.monotonic() - t0, 1),
                         **kernel_only, "growth_per_unit": per_unit}
    check("cycles", per_unit, COUNTS["cycles"] - quarter)
    assert k.execute("%%remote --all --fetch\n6 * 7").text == "{'worker1': 42, 'worker2': 42}"
    assert len(os.listdir("/dev/shm")) < 1000
