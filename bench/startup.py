"""Start-up, side by side in one run: how long until a group of 2 workers gives its first
result, cold and warm.

    .venv/bin/python -m bench.startup [--repeats N] [--warm N] [--out PATH]

Compared, in turns (the starting one rotates, so a burst of load from elsewhere hits each
alike), each from a fresh process:

- ``rpcnb cold``: a fresh IPython kernel runs ``%load_ext rpcnb``, ``%rpc_init --workers
  2`` and ``%%remote worker1 --fetch`` / ``1`` (timed in the kernel, from the first line to
  the value: what a notebook's first cells cost);
- ``script``: a plain Python that starts the same 3 processes itself, with ``init_rpc``
  in parallel (world size 3, a file store, TensorPipe on loopback) and makes one
  ``rpc_sync`` to worker1 (timed from its first line to the value);
- ``ipyparallel``: a fresh kernel runs ``ipp.Cluster(n=2).start_and_connect_sync()`` and
  one ``apply_sync`` (``bench.in_kernel.start_ipp``);
- ``rpcnb warm``: in one kernel, ``%rpc_shutdown`` and then again ``%rpc_init --workers
  2`` and the same first cell, ``--warm`` times (the workers come from the warm
  launcher that the first group left running).

Targets (issue 14): cold <= script + 0.5 s; cold <= 0.5x ipyparallel; warm <= 1 s.
Returns rows ``(name, samples, median)``; writes ``bench/results/startup.json`` with every
sample and the machine's facts. Every process started here is stopped by pid at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "startup.json"

SCRIPT_WORKER = """
import sys, torch.distributed.rpc as rpc
rank, store = int(sys.argv[1]), sys.argv[2]
rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3,
             rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}"))
rpc.shutdown()
"""

SCRIPT = """
import os, subprocess, sys, tempfile, time
t0 = time.perf_counter()
store = os.path.join(tempfile.mkdtemp(prefix="bench-start-"), "store")
workers = [subprocess.Popen([sys.executable, "-c", sys.argv[1], str(r), store]) for r in (1, 2)]
import torch.distributed.rpc as rpc
rpc.init_rpc("worker0", rank=0, world_size=3,
             rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}"))
value = rpc.rpc_sync("worker1", int, args=(1,))
print("@@", time.perf_counter() - t0, flush=True)
assert value == 1
rpc.shutdown()
for w in workers:
    w.wait(30)
"""


def warm_reinit(workers: int, reps: int, extra: str = "") -> dict[str, list[float]]:
    """In a kernel where a group ran and left: ``%rpc_init --workers N`` and the first
    ``%%remote`` value, ``reps`` times (each followed by ``%rpc_shutdown``, not timed)."""
    from IPython import get_ipython

    ip = get_ipython()
    perf = time.perf_counter
    out: dict[str, list[float]] = {"init_s": [], "total_s": []}
    for _ in range(reps):
        t0 = perf()
        ip.run_line_magic("rpc_init", f"--workers {workers} {extra}".strip())
        t1 = perf()
        value = ip.run_cell_magic("remote", "worker1 --fetch", "1")
        t2 = perf()
        assert value == 1, value
        out["init_s"].append(t1 - t0)
        out["total_s"].append(t2 - t0)
        ip.run_line_magic("rpc_shutdown", "")
    return out


def _helpers() -> Any:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import run

    return run


def time_script() -> float:
    """The plain script, from its first line to worker1's value."""
    import os
    import subprocess

    _helpers()
    from conftest import run_watched

    code, out, err, _ = run_watched(
        [sys.executable, "-c", SCRIPT, SCRIPT_WORKER], timeout=300, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TP_SOCKET_IFNAME": "lo", "TORCH_CPP_LOG_LEVEL": "ERROR"})
    for line in out.splitlines():
        if line.startswith("@@ "):
            return float(line[3:])
    raise RuntimeError(f"no timing from the script (exit {code}):\n{err[-2000:]}")


def time_kernel(which: str, rpc_args: str = "") -> dict[str, float]:
    """A fresh kernel: rpcnb's cold start or ipyparallel's, to the first result (with its
    parts: import/load, start, first result; bench.run's section 4 shows them)."""
    run = _helpers()
    k = run.new_kernel()
    stop = ["B.stop_rpcnb()" if which == "rpcnb" else "B.stop_ipp()"]
    try:
        start = f"B.start_rpcnb(2, {rpc_args!r})" if which == "rpcnb" else "B.start_ipp(2)"
        result: dict[str, float] = run.cell(k, f"B.emit({start})", timeout=300)
        return result
    finally:
        run.close_kernel(k, stop)


def time_warm(reps: int, rpc_args: str = "") -> dict[str, list[float]]:
    run = _helpers()
    k = run.new_kernel()
    try:
        run.cell(k, "import bench.startup as S")
        run.cell(k, f"B.emit(B.start_rpcnb(2, {rpc_args!r}))", timeout=300)  # cold: not counted
        run.cell(k, "%rpc_shutdown")
        result: dict[str, list[float]] = run.cell(
            k, f"B.emit(S.warm_reinit(2, {reps}, {rpc_args!r}))", timeout=300)
        return result
    finally:
        run.close_kernel(k, ["B.stop_rpcnb()"])


SECTION = "startup_cold_warm"  # a bench module of bench.run's (see bench.curves)


def measure_runs(repeats: int, warm: int, log: Any = None, rpc_args: str = "") -> dict[str, Any]:
    """Every sample of the four ways, cold ones in turns."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    samples: dict[str, list[float]] = {"rpcnb cold": [], "script": [], "ipyparallel": []}
    parts: dict[str, list[dict[str, float]]] = {"rpcnb cold": [], "ipyparallel": []}
    names = list(samples)
    for r in range(repeats):
        for name in names[r % 3:] + names[:r % 3]:
            say(f"start-up: {name}, {r + 1}/{repeats}")
            if name == "script":
                samples[name].append(time_script())
            else:
                got = time_kernel("rpcnb" if name == "rpcnb cold" else "ipp", rpc_args)
                parts[name].append(got)
                samples[name].append(got["total_s"])
    say(f"start-up: rpcnb warm re-init x{warm}")
    w = time_warm(warm, rpc_args)
    samples["rpcnb warm"] = w["total_s"]
    return {"samples": samples, "parts": parts, "warm_init_s": w["init_s"]}


def rows_of(measured: dict[str, Any]) -> list[tuple[str, list[float], float]]:
    return [(name, s, statistics.median(s)) for name, s in measured["samples"].items()]


def verdicts(measured: dict[str, Any]) -> list[dict[str, Any]]:
    med = {name: statistics.median(s) for name, s in measured["samples"].items()}
    cold, script, ipp, warm = (med["rpcnb cold"], med["script"], med["ipyparallel"],
                               med["rpcnb warm"])
    return [
        {"target": "cold %rpc_init --workers 2 <= script + 0.5 s", "ok": cold <= script + 0.5,
         "shown": f"{cold:.2f} s vs {script:.2f} + 0.5 s ({cold - script:+.2f} s)"},
        {"target": "cold %rpc_init --workers 2 <= 0.5x ipyparallel", "ok": cold <= 0.5 * ipp,
         "shown": f"{cold / ipp:.2f}x ({cold:.2f} vs {ipp:.2f} s)"},
        {"target": "warm re-init of 2 workers <= 1 s", "ok": warm <= 1.0,
         "shown": f"{warm:.2f} s"},
    ]


def table(measured: dict[str, Any]) -> str:
    lines = [f"{'start-up to the first result, 2 workers':<42} {'median':>8}   samples"]
    for name, s, med in rows_of(measured):
        lines.append(f"{name:<42} {med:7.2f}s   " + " ".join(f"{x:.2f}" for x in s))
    lines.append("")
    for v in verdicts(measured):
        lines.append(f"{v['target']:<48} {'met' if v['ok'] else 'MISSED':<7} {v['shown']}")
    return "\n".join(lines)


def measure(ctx: Any) -> dict[str, Any]:
    """``bench.run``'s entry: measure with its repeats; the samples and verdicts."""
    reps = max(1, int(ctx.cfg.get("startup_reps", 3)))
    warm = ctx.cfg.get(SECTION, {}).get("warm", 5 if reps > 1 else 2)  # bench.run's SMOKE
    measured = measure_runs(reps, warm, log=ctx.log, rpc_args=ctx.rpc_args)
    ctx.log("\n" + table(measured))
    return {**measured, "verdicts": verdicts(measured)}


def report(section: dict[str, Any], results: dict[str, Any]) -> Any:
    from bench.report import Part, target

    part = Part(title="Start-up: cold and warm")
    rows = [["start-up to the first result, 2 workers", "median s", "samples (s)"]]
    for name, samples, med in rows_of(section):
        rows.append([name, f"{med:.2f}", " ".join(f"{x:.2f}" for x in samples)])
    part.tables.append(("Cold: a fresh kernel (or script) to its first result; warm: "
                        "%rpc_init --workers 2 after %rpc_shutdown", rows))
    for v in section["verdicts"]:
        part.targets.append(target(v["target"], None, None, v["ok"], v["shown"]))
    return part


def main(argv: list[str] | None = None) -> list[tuple[str, list[float], float]]:
    ap = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="fresh processes of each cold way")
    ap.add_argument("--warm", type=int, default=7, help="warm re-inits in one kernel")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    run = _helpers()
    import os

    from bench import python_path

    os.chdir(ROOT)  # workers and engines import bench.* from here
    os.environ["PYTHONPATH"] = python_path()
    info = run.machine()
    measured = measure_runs(args.repeats, args.warm)
    info["loadavg_end"] = list(os.getloadavg())
    text = table(measured)
    print(text)
    doc = {"machine": info, "repeats": args.repeats, "warm": args.warm, **measured,
           "verdicts": verdicts(measured), "table": text}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return rows_of(measured)


if __name__ == "__main__":
    main()
