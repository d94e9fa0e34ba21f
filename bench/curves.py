"""Curves, not points (issue 14, item 4): one-way time against size for each path, and
init time against the number of workers; fan-out against workers comes from benchmark 3.

A bench module contributes to ``make bench`` (``bench.run``) and to its tables and figures
(``bench.report``: the PNGs on docs/benchmarks.md) by offering, at module level:

- ``SECTION``: its key in the JSON's ``results``;
- ``measure(ctx) -> dict``: runs it (``ctx`` is ``bench.run.Context``: the settings,
  ``--quick``, the ``%rpc_init`` extras, and helpers that start kernels and run cells);
  what it returns is stored under ``results[SECTION]``, every sample kept;
- ``report(section, results) -> bench.report.Part``: its tables (rows of strings), its
  curves (series of points, drawn as PNG) and its targets (with verdicts), computed from
  the JSON only, so the docs' figures never disagree with its tables.

``bench.tables.MODULES`` lists them (``bench.curves``, ``bench.idle``, ``bench.startup``); one
that is not in the tree is skipped.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

SECTION = "curves"

KB = 1 << 10
SIZES_FULL = [4 * KB << (2 * i) for i in range(8)] + [512 << 20]  # 4 KB .. 64 MB x4, 512 MB
SIZES_FULL = sorted(set(SIZES_FULL + [100 << 20]))  # and the targets' 100 MB
SIZES_QUICK = [4 * KB, 256 * KB, 4 << 20]
PATHS = ["tensorpipe", "rpcnb shm", "zero-copy", "memcpy"]
INIT_WORKERS_FULL = [1, 2, 4, 8]
SETTLE_S = 0.05  # untimed pause before each one-way send
INIT_WORKERS_QUICK = [1]


def reps_for(nbytes: int, quick: bool) -> int:
    if quick:
        return 3
    return 20 if nbytes <= 4 << 20 else 10 if nbytes <= 64 << 20 else 5


# --------------------------------------------------------------------------- in the kernel


def one_way(sizes: list[int], quick: bool, warmup: int = 2,
            reps: int | None = None) -> dict[str, Any]:
    """Runs in a kernel that is worker0 of a group with worker1: per size, the round
    trip of ``rpc_sync("worker1", consume, args=(t,))`` for a tensor that is not shared
    (TensorPipe: rpcnb's paths off; rpcnb shm: the pool-buffer copy) and for a
    ``share_memory_()`` tensor (zero-copy), and ``dst.copy_(t)`` (memcpy), taking turns.
    Each path's counters say whether it really carried the sends."""
    from rpcnb.paths import shm

    try:
        return {"sizes": {str(nbytes): _one_size(nbytes, reps or reps_for(nbytes, quick), warmup)
                          for nbytes in sizes}}
    finally:
        shm.set_enabled(True)


def _one_size(nbytes: int, reps: int, warmup: int) -> dict[str, Any]:
    import torch
    import torch.distributed.rpc as rpc

    from bench.targets import consume
    from rpcnb.paths import shm, zerocopy

    perf = time.perf_counter
    n = nbytes // 4
    plain = torch.ones(n)
    shared = torch.ones(n)
    shared.share_memory_()
    dst = torch.empty_like(plain)
    dst.copy_(plain)
    samples: dict[str, list[float]] = {p: [] for p in PATHS}
    taken = {"rpcnb shm": 0, "zero-copy": 0}

    def once(path: str, record: bool) -> None:
        # every send starts with worker1 idle: a large TensorPipe send keeps the worker
        # busy (freeing what it received) after its reply, which the next send would pay
        time.sleep(SETTLE_S)
        if path == "memcpy":
            t0 = perf()
            dst.copy_(plain)
            dt = perf() - t0
        else:
            shm.set_enabled(path != "tensorpipe")
            t = shared if path == "zero-copy" else plain
            before = (shm.stats()["sent"], zerocopy.stats()["sent"])
            t0 = perf()
            got = rpc.rpc_sync("worker1", consume, args=(t,))
            dt = perf() - t0
            assert got == n, got
            if record and path == "rpcnb shm":
                taken[path] += shm.stats()["sent"] - before[0]
            if record and path == "zero-copy":
                taken[path] += zerocopy.stats()["sent"] - before[1]
        if record:
            samples[path].append(dt)

    for path in PATHS:
        for _ in range(warmup):
            once(path, False)
    for r in range(reps):
        for path in PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]:
            once(path, True)
    return {"samples_ms": {p: [round(x * 1e3, 4) for x in v] for p, v in samples.items()},
            "taken": taken}


# --------------------------------------------------------------------------- the runner


def measure(ctx: Any) -> dict[str, Any]:
    own = ctx.cfg.get(SECTION, {})  # bench.run's SMOKE
    sizes = own.get("sizes", SIZES_QUICK if ctx.quick else SIZES_FULL)
    # one_way(sizes, quick[, warmup, reps]): without reps of its own, the module's
    args = [sizes, ctx.quick] + ([own.get("warmup", 2), own["reps"]] if "reps" in own else [])
    result: dict[str, Any] = {}
    ctx.log(f"curves: one-way time for {len(sizes)} sizes, 4 paths")
    k = ctx.new_kernel()
    try:
        ctx.cell(k, "%load_ext rpcnb")
        ctx.cell(k, f"%rpc_init --workers 1 {ctx.rpc_args}".strip(), timeout=300)
        ctx.cell(k, "import bench.curves as C")
        result["one_way"] = ctx.cell(k, f"B.emit(C.one_way({', '.join(map(repr, args))}))",
                                     timeout=900)
    finally:
        ctx.close_kernel(k, ["B.stop_rpcnb()"])
    counts = INIT_WORKERS_QUICK if ctx.quick else INIT_WORKERS_FULL
    reps = 1 if ctx.quick else 2
    init: dict[str, list[dict[str, float]]] = {str(n): [] for n in counts}
    for r in range(reps):
        for n in counts:
            ctx.log(f"curves: init of {n} workers, fresh kernel ({r + 1}/{reps})")
            k = ctx.new_kernel()
            try:
                init[str(n)].append(ctx.cell(k, f"B.emit(B.start_rpcnb({n}, {ctx.rpc_args!r}))",
                                             timeout=300))
            finally:
                ctx.close_kernel(k, ["B.stop_rpcnb()"])
    result["init"] = init
    return result


def _median(values: list[float]) -> float:
    return statistics.median(values)


def report(section: dict[str, Any], results: dict[str, Any]) -> Any:
    from bench.report import Curve, Part, target

    part = Part(title="Curves")
    one = (section.get("one_way") or {}).get("sizes", {})
    if one:
        series: dict[str, list[list[float]]] = {p: [] for p in PATHS}
        rows = [["one-way, size"] + [f"{p} ms" for p in PATHS] + ["tp/rpcnb shm", "rpcnb shm/memcpy"]]
        for key in sorted(one, key=int):
            nbytes = int(key)
            med = {p: _median(v) for p, v in one[key]["samples_ms"].items() if v}
            for p, m in med.items():
                series[p].append([nbytes, m])
            rows.append([_size(nbytes)] + [f"{med[p]:.3f}" for p in PATHS]
                        + [f"{med['tensorpipe'] / med['rpcnb shm']:.2f}x",
                           f"{med['rpcnb shm'] / med['memcpy']:.2f}x"])
            taken = one[key]["taken"]
            n = len(one[key]["samples_ms"]["zero-copy"])
            for col, path in ((2, "rpcnb shm"), (3, "zero-copy")):  # what the counters saw
                if taken.get(path, 0) < n:
                    rows[-1][col] += f" ({taken.get(path, 0)}/{n} took it)"
            if nbytes == 100 << 20:
                r = med["tensorpipe"] / med["rpcnb shm"]
                shown = f"{r:.2f}x ({med['rpcnb shm']:.2f} vs {med['tensorpipe']:.2f} ms)"
                part.targets.append(target("100 MB not shared: rpcnb >= 8x tensorpipe", r, 8.0,
                                           r >= 8.0, shown))
                r = med["rpcnb shm"] / med["memcpy"]
                shown = f"{r:.2f}x ({med['rpcnb shm']:.2f} vs {med['memcpy']:.2f} ms)"
                part.targets.append(target("100 MB not shared: rpcnb <= 1.5x one memcpy", r, 1.5,
                                           r <= 1.5, shown))
            if nbytes in (100 << 20, 512 << 20):
                z = med["zero-copy"]
                smallest = one[min(one, key=int)]["samples_ms"]["tensorpipe"]
                floor = f"; {_size(int(min(one, key=int)))} round trip {_median(smallest):.3f} ms" \
                    if smallest else ""
                shown = f"{z:.3f} ms ({taken.get('zero-copy', 0)}/{n} by handle{floor})"
                part.targets.append(target(f"{_size(nbytes)} share_memory_() tensor < 1 ms", z, 1.0,
                                           z < 1.0, shown))
        part.tables.append(("One-way CPU tensor by path (medians; time = rpc_sync round trip of "
                            "consume(t), which answers t.numel())", rows))
        part.curves.append(Curve("oneway", "One-way CPU tensor to a worker on this host",
                                 "tensor size (bytes)", "time (ms)", series, xlog=True, ylog=True))
    init = section.get("init") or {}
    if init:
        rows = [["init, workers", "start s (median)", "first result s", "total s", "runs"]]
        series = {"%rpc_init --workers n to first result": []}
        for key in sorted(init, key=int):
            runs = init[key]
            total = _median([r["total_s"] for r in runs])
            series["%rpc_init --workers n to first result"].append([int(key), total])
            rows.append([key, f"{_median([r['init_s'] for r in runs]):.2f}",
                         f"{_median([r['first_result_s'] for r in runs]):.3f}", f"{total:.2f}",
                         " ".join(f"{r['total_s']:.2f}" for r in runs)])
        part.tables.append(("Init time against workers (fresh kernel each; bench.startup "
                            "has cold against warm, side by side with a script and "
                            "ipyparallel)", rows))
        part.curves.append(Curve("init", "Fresh kernel to first result", "workers", "seconds",
                                 series, xlog=False, ylog=False))
    fan = results.get("fanout") or {}
    if fan:
        counts = sorted({int(k.split()[-1]) for k in fan})
        series = {label: [[n, fan[f"{key} {n}"]["median_ms"]] for n in counts if f"{key} {n}" in fan]
                  for key, label in (("raw", "raw rpc_async"), ("api", "rpcnb.run"),
                                     ("magic", "%%remote"))}
        part.curves.append(Curve("fanout", "Fan-out of a no-op cell", "workers", "time (ms)",
                                 series, xlog=False, ylog=False))
    return part


def _size(nbytes: int) -> str:
    if nbytes >= 1 << 20:
        return f"{nbytes >> 20} MB"
    return f"{nbytes >> 10} KB"
