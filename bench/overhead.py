"""What rpcnb costs the calls a user's own torch RPC code makes, side by side in one run.

    .venv/bin/python -m bench.overhead [--calls 300] [--turns 3] [--out PATH]

A group of two processes on this host is started twice per turn: by torch's own
``init_rpc`` (the ``torch`` column) and by ``rpcnb.init(1)`` (the ``rpcnb`` column), with the
same transport (TensorPipe's ``uv`` on loopback). Each runs the same calls from a plain
Python driver: ``rpc_sync``/``rpc_async``/``remote`` of an importable Python function and of
builtins, and ``to_here``. The drivers take turns (torch, rpcnb, torch, ...), each figure
is the median over the turns of the median call time, and the ratio is rpcnb / torch.

The rpcnb driver also times what only rpcnb has, against what a user would compare it
with: ``rpcnb.run(worker, "None")`` against a raw ``rpc_sync`` of a no-op, a Ray actor
call (when Ray is installed; skipped with a message otherwise), large tensors to builtins
against the same to a Python function, ``share_memory_()`` tensors sent by handle, and
``--push x --fetch`` of 100 MB (``rpcnb.run(..., push=, fetch=True)``) against a memcpy.
Targets are in ``TARGETS``; the JSON has every figure and whether each target was met.

A bench module for ``bench.run`` / ``bench.report`` too (``SECTION``, ``measure``,
``report``: see ``bench.curves``), so ``make bench`` runs it and docs/benchmarks.md shows it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MB = 1 << 20
SECTION = "overhead"

# (row, measured, against, at most this ratio)
TARGETS = [
    ("rpc_sync python fn", "rpcnb", "torch", 1.05),
    ("rpc_sync python fn, 16 floats", "rpcnb", "torch", 1.05),
    ("rpc_sync builtin torch.add", "rpcnb", "torch", 1.05),
    ("rpc_async python fn", "rpcnb", "torch", 1.05),
    ("remote().to_here()", "rpcnb", "torch", 1.05),
    ("rpcnb.run no-op", "rpcnb", "rpc_sync python fn", 1.2),
    ("100 MB to builtin", "rpcnb", "100 MB to python fn", 1.2),
    ("push+fetch 100 MB", "rpcnb", "memcpy 100 MB", 1.5),
]

DRIVER = r'''
import json, os, statistics, sys, time
mode, calls = sys.argv[1], int(sys.argv[2])
os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
import torch
import torch.distributed.rpc as rpc
from bench.targets import consume, noop

def timed(fn, n=calls, warm=20):
    for _ in range(warm):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3

if mode == "torch":
    import subprocess, tempfile
    store = os.path.join(tempfile.mkdtemp(prefix="bench-overhead-"), "store")
    def opts():
        return rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}",
                                               num_worker_threads=16, _transports=["uv"])
    peer = subprocess.Popen([sys.executable, "-c",
        "import os, sys, torch.distributed.rpc as rpc\n"
        f"o = rpc.TensorPipeRpcBackendOptions(init_method='file://{store}', "
        "num_worker_threads=16, _transports=['uv'])\n"
        "rpc.init_rpc('worker1', rank=1, world_size=2, rpc_backend_options=o)\n"
        "rpc.shutdown()\n"])
    rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=opts())
else:
    import rpcnb
    rpcnb.init(1)

small = torch.ones(16)
a, b = torch.ones(4), torch.ones(4)
rows = {
    "rpc_sync python fn": timed(lambda: rpc.rpc_sync("worker1", noop)),
    "rpc_sync python fn, 16 floats": timed(lambda: rpc.rpc_sync("worker1", consume, args=(small,))),
    "rpc_sync builtin torch.add": timed(lambda: rpc.rpc_sync("worker1", torch.add, args=(a, b))),
    "rpc_async python fn": timed(lambda: rpc.rpc_async("worker1", noop).wait()),
    "remote().to_here()": timed(lambda: rpc.remote("worker1", torch.add, args=(a, b)).to_here()),
}
if mode == "rpcnb":
    rows["rpcnb.run no-op"] = timed(lambda: rpcnb.run("worker1", "None", fetch=True))
    big = torch.ones(25 * 1024 * 1024)  # 100 MB
    few = max(5, calls // 30)
    rows["100 MB to python fn"] = timed(lambda: rpc.rpc_sync("worker1", consume, args=(big,)), few, 2)
    rows["100 MB to builtin"] = timed(lambda: rpc.rpc_sync("worker1", torch.numel, args=(big,)), few, 2)
    for size in (1, 512):
        shared = torch.ones(size * 1024 * 1024 // 4).share_memory_()
        rows[f"shared {size} MB to python fn"] = timed(
            lambda: rpc.rpc_sync("worker1", consume, args=(shared,)), few, 2)
        rows[f"shared {size} MB to builtin"] = timed(
            lambda: rpc.rpc_sync("worker1", torch.numel, args=(shared,)), few, 2)
        del shared
    dst = torch.empty_like(big)
    rows["memcpy 100 MB"] = timed(lambda: dst.copy_(big), few, 2)
    rows["push+fetch 100 MB"] = timed(
        lambda: rpcnb.run("worker1", "x", push={"x": big}, fetch=True), few, 2)
    rpcnb.shutdown()
else:
    rpc.shutdown()
    peer.wait(30)
print("ROWS " + json.dumps(rows))
'''

RAY = r'''
import json, statistics, sys, time
import ray
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
@ray.remote
class A:
    def noop(self):
        return None
a = A.remote()
ray.get(a.noop.remote())
out = []
for i in range(int(sys.argv[1]) + 20):
    t0 = time.perf_counter()
    ray.get(a.noop.remote())
    if i >= 20:
        out.append(time.perf_counter() - t0)
print("ROWS " + json.dumps({"ray actor call": statistics.median(out) * 1e3}))
ray.shutdown()
'''


def _run(code: str, *args: str, timeout: float = 600) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=tempfile.gettempdir(), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, 9)  # its worker too
        except ProcessLookupError:
            pass
        proc.wait()
    found = [line for line in out.splitlines() if line.startswith("ROWS ")]
    if not found:
        raise RuntimeError(f"{args} printed no figures:\n{out[-3000:]}")
    return json.loads(found[-1][5:])


def _has_ray() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def measure_turns(calls: int = 300, turns: int = 3) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"torch": [], "rpcnb": [], "ray": []}
    ray = _has_ray()
    for _ in range(turns):
        runs["torch"].append(_run(DRIVER, "torch", str(calls)))
        runs["rpcnb"].append(_run(DRIVER, "rpcnb", str(calls)))
        if ray:
            runs["ray"].append(_run(RAY, str(calls)))
    med = {mode: {row: statistics.median(r[row] for r in rs) for row in rs[0]}
           for mode, rs in runs.items() if rs}
    rows = []
    for row in med["rpcnb"]:
        rows.append({"call": row, "torch_ms": med["torch"].get(row), "rpcnb_ms": med["rpcnb"][row]})
    if ray:
        rows.append({"call": "ray actor call", "torch_ms": None, "rpcnb_ms": None,
                     "ray_ms": med["ray"]["ray actor call"]})
    targets = []
    for row, _measured, against, limit in TARGETS:
        value = med["rpcnb"][row]
        base = med["torch"][row] if against == "torch" else med["rpcnb"][against]
        targets.append({"row": row, "against": against, "ratio": value / base, "limit": limit,
                        "met": value / base <= limit})
    if ray:
        value, base = med["rpcnb"]["rpcnb.run no-op"], med["ray"]["ray actor call"]
        targets.append({"row": "rpcnb.run no-op", "against": "ray actor call",
                        "ratio": value / base, "limit": 1.0, "met": value <= base})
    for size in (1, 512):
        for kind in ("python fn", "builtin"):
            value = med["rpcnb"][f"shared {size} MB to {kind}"]
            targets.append({"row": f"shared {size} MB to {kind}", "against": "2 ms",
                            "ratio": value / 2.0, "limit": 1.0, "met": value < 2.0})
    return {"calls": calls, "turns": turns, "rows": rows, "targets": targets,
            "ray": "measured" if ray else "not installed: pip install ray to compare"}


def table(result: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "" if value is None else f"{value:.3f}"

    lines = [f"{'call':34s} {'torch ms':>9s} {'rpcnb ms':>9s} {'ratio':>6s}"]
    for r in result["rows"]:
        if "ray_ms" in r:
            lines.append(f"{r['call']:34s} {'':>9s} {ms(r['ray_ms']):>9s}  (Ray)")
            continue
        ratio = f"{r['rpcnb_ms'] / r['torch_ms']:.2f}" if r["torch_ms"] else ""
        lines.append(f"{r['call']:34s} {ms(r['torch_ms']):>9s} {ms(r['rpcnb_ms']):>9s} {ratio:>6s}")
    lines += ["", "targets:"]
    for t in result["targets"]:
        lines.append(f"  {'met ' if t['met'] else 'MISS'} {t['row']} vs {t['against']}: "
                     f"{t['ratio']:.2f}x (at most {t['limit']}x)")
    if result["ray"] != "measured":
        lines.append(f"  Ray: {result['ray']}")
    return "\n".join(lines)


def measure(ctx: Any) -> dict[str, Any]:
    calls, turns = (100, 1) if ctx.quick else (300, 3)
    ctx.log(f"overhead: torch-only and rpcnb groups in turns, {calls} calls, {turns} turns")
    return measure_turns(calls, turns)


def report(section: dict[str, Any], results: dict[str, Any]) -> Any:
    from bench.report import Part, target

    part = Part(title="What rpcnb costs plain torch RPC calls")
    rows = [["call", "torch ms", "rpcnb ms", "ratio"]]
    for r in section["rows"]:
        if "ray_ms" in r:
            rows.append([r["call"], "", f"{r['ray_ms']:.3f} (Ray)", ""])
            continue
        t = r["torch_ms"]
        rows.append([r["call"], "" if t is None else f"{t:.3f}", f"{r['rpcnb_ms']:.3f}",
                     "" if t is None else f"{r['rpcnb_ms'] / t:.2f}x"])
    part.tables.append((f"medians of {section['turns']} turns of {section['calls']} calls, groups "
                        "of two on one host started by torch's init_rpc and by rpcnb.init(1), "
                        "TensorPipe uv on loopback (bench/overhead.py)", rows))
    for t in section["targets"]:
        part.targets.append(target(f"{t['row']} <= {t['limit']:g}x {t['against']}", t["ratio"],
                                   t["limit"], t["met"], f"{t['ratio']:.2f}x"))
    return part


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "overhead.json"))
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    result = measure_turns(args.calls, args.turns)
    result["seconds"] = round(time.monotonic() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
