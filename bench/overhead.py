"""What rpcnb costs the calls a user's own torch RPC code makes, side by side in one run.

    .venv/bin/python -m bench.overhead [--calls 100] [--turns 40] [--out PATH]

Two groups of two processes on this host run at once: one started by torch's own
``init_rpc`` (the ``torch`` column), one by ``rpcnb.init(1)`` (the ``rpcnb`` column), with the
same transport (TensorPipe's ``uv`` on loopback). Each is driven by a plain Python process
that makes the same calls: ``rpc_sync``/``rpc_async``/``remote`` of an importable Python
function and of builtins, ``to_here``, and the tutorials' ``_call_method(Cls.method, rref,
...)`` (a function and an RRef among the arguments). The two drivers take turns in batches of
``--calls`` calls (``--turns`` turns of one batch each, torch first in one turn and rpcnb
first in the next) while the other group idles, so both columns meet the same load on the
machine (on a shared 2-core machine, figures taken minutes apart differ by more than what
is measured); each figure is the median of all its calls, and the ratio is rpcnb / torch.
The ratio of each turn's two batches is kept too: their lowest and highest (``turns`` in the
table) say how far this machine moved the ratio while it was measured.

The rpcnb driver also times what only rpcnb has, against what a user would compare it
with: ``rpcnb.run(worker, "None")`` against a raw ``rpc_sync`` of a no-op in the torch-only
group (in turns too), against a raw ``rpc_sync`` in its own group call by call (the two
one right after the other, so both meet the same moment of a noisy machine), and against a
Ray actor call (when Ray is installed: ``make
bench-ray``; skipped with a message otherwise), large tensors to builtins against the same
to a Python function, ``share_memory_()`` tensors sent by handle, and ``--push x --fetch``
of 100 MB (``rpcnb.run(..., push=, fetch=True)``) against a memcpy. A row measured
against another of these takes turns with it (ABBA), and each turn's ratio is kept.
Targets are in ``TARGETS``; the JSON has every figure and whether each target was met.

A bench module for ``bench.run`` / ``bench.report`` too (``SECTION``, ``measure``,
``report``: see ``bench.curves``), so ``make bench`` runs it; docs/benchmarks.md's table shows
rows of both runs (``scripts/bench_table.py``).
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

from bench import python_path

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
    ("rpc_sync method via RRef", "rpcnb", "torch", 1.05),
    ("rpcnb.run no-op", "rpcnb", "torch rpc_sync python fn", 1.2),
    ("rpcnb.run no-op, paired", "rpcnb", "rpc_sync python fn, paired", 1.2),
    ("100 MB to builtin", "rpcnb", "100 MB to python fn", 1.2),
    ("push+fetch 100 MB", "rpcnb", "memcpy 100 MB", 1.5),
]

DRIVER = r"""
import json, os, sys, time
mode = sys.argv[1]
PAIRED = "rpcnb.run no-op, paired"
os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
import torch
import torch.distributed.rpc as rpc
from bench.targets import Counter, call_method, consume, noop

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
counter = rpc.remote("worker1", Counter)  # the tutorials' pattern: _call_method on an RRef
rows = {
    "rpc_sync python fn": lambda: rpc.rpc_sync("worker1", noop),
    "rpc_sync python fn, 16 floats": lambda: rpc.rpc_sync("worker1", consume, args=(small,)),
    "rpc_sync builtin torch.add": lambda: rpc.rpc_sync("worker1", torch.add, args=(a, b)),
    "rpc_async python fn": lambda: rpc.rpc_async("worker1", noop).wait(),
    "remote().to_here()": lambda: rpc.remote("worker1", torch.add, args=(a, b)).to_here(),
    "rpc_sync method via RRef": lambda: rpc.rpc_sync(
        "worker1", call_method, args=(Counter.step, counter, a)),
}
if mode == "rpcnb":
    big = torch.ones(25 * 1024 * 1024)  # 100 MB
    shared = {size: torch.ones(size * 1024 * 1024 // 4).share_memory_() for size in (1, 512)}
    dst = torch.empty_like(big)
    rows.update({
        "rpcnb.run no-op": lambda: rpcnb.run("worker1", "None", fetch=True),
        "100 MB to python fn": lambda: rpc.rpc_sync("worker1", consume, args=(big,)),
        "100 MB to builtin": lambda: rpc.rpc_sync("worker1", torch.numel, args=(big,)),
        "memcpy 100 MB": lambda: dst.copy_(big),
        "push+fetch 100 MB": lambda: rpcnb.run("worker1", "x", push={"x": big}, fetch=True),
    })
    for size, t in shared.items():
        rows[f"shared {size} MB to python fn"] = lambda t=t: rpc.rpc_sync("worker1", consume, args=(t,))
        rows[f"shared {size} MB to builtin"] = lambda t=t: rpc.rpc_sync("worker1", torch.numel, args=(t,))
print("READY", flush=True)
def paired():  # a raw rpc_sync and a no-op cell, one right after the other: [raw s, cell s]
    t0 = time.perf_counter()
    rpc.rpc_sync("worker1", noop)
    t1 = time.perf_counter()
    rpcnb.run("worker1", "None", fetch=True)
    return [t1 - t0, time.perf_counter() - t1]
for line in sys.stdin:  # {"row": ..., "n": ..., "warm": ...}: time n calls, print them
    ask = json.loads(line)
    if ask.get("quit"):
        break
    if ask["row"] == PAIRED:
        for _ in range(ask["warm"]):
            paired()
        print("TIMES " + json.dumps([paired() for _ in range(ask["n"])]), flush=True)
        continue
    fn = rows[ask["row"]]
    for _ in range(ask["warm"]):
        fn()
    out = []
    for _ in range(ask["n"]):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    print("TIMES " + json.dumps(out), flush=True)
if mode == "rpcnb":
    rpcnb.shutdown()
else:
    rpc.shutdown()
    peer.wait(30)
    import shutil
    shutil.rmtree(os.path.dirname(store), ignore_errors=True)
"""

# the no-op cell and a raw rpc_sync, call by call (the driver names the first, as DRIVER says)
PAIRED, PAIRED_RAW = "rpcnb.run no-op, paired", "rpc_sync python fn, paired"
assert f'PAIRED = "{PAIRED}"' in DRIVER

# rows only the rpcnb driver has, and how many calls a batch of each makes (of ``calls``)
RPCNB_ONLY = {"rpcnb.run no-op": 1, "100 MB to python fn": 30, "100 MB to builtin": 30,
              "shared 1 MB to python fn": 30, "shared 1 MB to builtin": 30,
              "shared 512 MB to python fn": 30, "shared 512 MB to builtin": 30,
              "memcpy 100 MB": 30, "push+fetch 100 MB": 30, PAIRED_RAW: 1, PAIRED: 1}
BOTH = ["rpc_sync python fn", "rpc_sync python fn, 16 floats", "rpc_sync builtin torch.add",
        "rpc_async python fn", "remote().to_here()", "rpc_sync method via RRef"]

# What a driver of one kind of call serves once its ``one()`` is defined: ``n`` calls timed
# after ``warm`` untimed ones, per line asked on stdin (as Driver.batch asks)
ONE_CALL = r"""
print("READY", flush=True)
for line in sys.stdin:
    ask = json.loads(line)
    if ask.get("quit"):
        break
    for _ in range(ask["warm"]):
        one()
    out = []
    for _ in range(ask["n"]):
        t0 = time.perf_counter()
        one()
        out.append(time.perf_counter() - t0)
    print("TIMES " + json.dumps(out), flush=True)
"""

RAY = r"""
import json, sys, time
import ray
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
@ray.remote
class A:
    def noop(self):
        return None
a = A.remote()
def one():
    ray.get(a.noop.remote())
one()
""" + ONE_CALL + "ray.shutdown()\n"

# the floor of a no-op call between two processes: one byte there and back over two pipes
# (a call is at least that: a wake-up of the other process and one of this one)
PIPE = r"""
import json, os, sys, time
r1, w1 = os.pipe()
r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(w1); os.close(r2)
    while True:
        b = os.read(r1, 1)
        if not b:
            os._exit(0)
        os.write(w2, b)
os.close(r1); os.close(w2)
def one():
    os.write(w1, b"x")
    os.read(r2, 1)
""" + ONE_CALL + "os.close(w1)\nos.waitpid(pid, 0)\n"
PIPE_ROW = "pipe round trip"


class Driver:
    """One driver process (a group of two, or Ray), asked for batches of timed calls."""

    def __init__(self, code: str, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=python_path(), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-c", code, *args],
                                     cwd=tempfile.gettempdir(), env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.seen: list[str] = []
        self._until("READY")

    def _until(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line
            self.seen.append(line)
        raise RuntimeError(f"{self.proc.args[3:]} stopped:\n{''.join(self.seen[-60:])}")

    def batch(self, row: str, n: int, warm: int) -> list[Any]:
        """``n`` calls' times in ms (for ``PAIRED``: ``[raw, cell]`` pairs)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"row": row, "n": n, "warm": warm}) + "\n")
        self.proc.stdin.flush()
        return [[x * 1e3 for x in t] if isinstance(t, list) else t * 1e3
                for t in json.loads(self._until("TIMES ")[6:])]

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            try:
                os.killpg(self.proc.pid, 9)  # its worker too
            except ProcessLookupError:
                pass
            self.proc.wait()


def _has_ray() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _rpcnb_only_groups() -> list[list[str]]:
    """The rpcnb driver's own batched rows (``RPCNB_ONLY``, not the call-by-call ones): a
    row with a target against another such row as ``[row, base]``, every other alone."""
    batched = [row for row, share in RPCNB_ONLY.items() if share > 1]
    pairs = [[row, base] for row, _measured, base, _limit in TARGETS
             if row in batched and base in batched]
    paired = {row for pair in pairs for row in pair}
    return pairs + [[row] for row in batched if row not in paired]


def measure_turns(calls: int = 300, turns: int = 3) -> dict[str, Any]:
    """Both groups run at once, idle but for the batch asked of one of them: each row's
    batches alternate torch, rpcnb, torch, ... (``turns`` of each), so both columns meet
    the same load on the machine. Ray, when installed, is up for the no-op rows only (it
    takes its turns there). Each figure is the median of all its calls."""
    ray = _has_ray()
    drivers = {"torch": Driver(DRIVER, "torch"), "rpcnb": Driver(DRIVER, "rpcnb")}
    times: dict[str, dict[str, list[float]]] = {"torch": {}, "rpcnb": {}, "ray": {}}
    # each turn's two batches of a row, for the spread between turns (the table shows it)
    turn_ratios: dict[str, list[float]] = {}
    try:
        for row in BOTH:
            for turn in range(turns):
                got = {}
                # which group goes first alternates (ABBA): the second batch of a turn meets
                # a machine the first has just warmed (or loaded)
                for mode in ("torch", "rpcnb") if turn % 2 == 0 else ("rpcnb", "torch"):
                    got[mode] = drivers[mode].batch(row, calls, 20)
                    times[mode].setdefault(row, []).extend(got[mode])
                turn_ratios.setdefault(row, []).append(
                    statistics.median(got["rpcnb"]) / statistics.median(got["torch"]))
        # Ray's own processes (its raylet, GCS and actor) keep working while idle: on a
        # small machine they slow whatever else runs. Ray is up for the no-op rows only,
        # where it is compared, and gone again before the large transfers.
        if ray:
            drivers["ray"] = Driver(RAY)
        drivers["floor"] = Driver(PIPE)
        times["floor"] = {}
        peers = [("rpcnb", "rpcnb.run no-op", "rpcnb.run no-op"),
                 ("torch", "rpc_sync python fn (again)", "rpc_sync python fn"),
                 ("floor", PIPE_ROW, "")]
        if ray:
            peers.append(("ray", "ray actor call", ""))
        for turn in range(turns):
            for mode, row, ask in peers[turn % len(peers):] + peers[:turn % len(peers)]:
                times[mode].setdefault(row, []).extend(drivers[mode].batch(ask, calls, 20))
            # the same cell against a raw rpc_sync in its own group, call by call: both
            # meet the same moment of this VM (the rows above are minutes of batches apart)
            for raw, cell in drivers["rpcnb"].batch(PAIRED, calls, 20):
                times["rpcnb"].setdefault(PAIRED_RAW, []).append(raw)
                times["rpcnb"].setdefault(PAIRED, []).append(cell)
        if ray:
            drivers.pop("ray").close()
        drivers.pop("floor").close()
        # a row measured against another of this driver's takes turns with it (ABBA), as the
        # two groups do above: this VM's memory bandwidth moves within a minute, and a
        # memcpy and the push+fetch it is compared with, seconds apart, differed by a third
        for group in _rpcnb_only_groups():
            for turn in range(turns):
                got = {}
                for row in group if turn % 2 == 0 else group[::-1]:
                    got[row] = drivers["rpcnb"].batch(row, max(5, calls // RPCNB_ONLY[row]), 2)
                    times["rpcnb"].setdefault(row, []).extend(got[row])
                if len(group) == 2:  # the measured row over its base, this turn
                    turn_ratios.setdefault(group[0], []).append(
                        statistics.median(got[group[0]]) / statistics.median(got[group[1]]))
    finally:
        for d in drivers.values():
            d.close()
    med = {mode: {row: statistics.median(v) for row, v in rows.items()}
           for mode, rows in times.items()}
    rows: list[dict[str, Any]] = [
        {"call": row, "torch_ms": med["torch"].get(row), "rpcnb_ms": med["rpcnb"][row]}
        for row in [*BOTH, *RPCNB_ONLY]]
    for r in rows:
        spread = sorted(turn_ratios.get(r["call"], []))
        if spread:  # rpcnb / torch of each turn's two batches: lowest, median, highest
            r["turn_ratios"] = [spread[0], statistics.median(spread), spread[-1]]
    if ray:
        rows.append({"call": "ray actor call", "torch_ms": None, "rpcnb_ms": None,
                     "ray_ms": med["ray"]["ray actor call"]})
    rows.append({"call": PIPE_ROW, "torch_ms": None, "rpcnb_ms": None,
                 "floor_ms": med["floor"][PIPE_ROW]})
    targets = []
    for row, _measured, against, limit in TARGETS:
        value = med["rpcnb"][row]
        if against == "torch":
            base = med["torch"][row]
        elif against == "torch rpc_sync python fn":  # the raw call, in a torch-only group
            base = med["torch"]["rpc_sync python fn (again)"]
        else:
            base = med["rpcnb"][against]
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
            "ray": "measured" if ray else "not installed: `make bench-ray` runs this with Ray"}


def table(result: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "" if value is None else f"{value:.3f}"

    lines = [f"{'call':34s} {'torch ms':>9s} {'rpcnb ms':>9s} {'ratio':>6s}  turns"]
    for r in result["rows"]:
        if "ray_ms" in r:
            lines.append(f"{r['call']:34s} {'':>9s} {ms(r['ray_ms']):>9s}  (Ray)")
            continue
        if "floor_ms" in r:
            lines.append(f"{r['call']:34s} {'':>9s} {ms(r['floor_ms']):>9s}  (floor)")
            continue
        ratio = f"{r['rpcnb_ms'] / r['torch_ms']:.2f}" if r["torch_ms"] else ""
        lo, _mid, hi = r.get("turn_ratios") or (None, None, None)
        spread = f"  {lo:.2f}-{hi:.2f}" if lo is not None else ""
        lines.append(f"{r['call']:34s} {ms(r['torch_ms']):>9s} {ms(r['rpcnb_ms']):>9s} "
                     f"{ratio:>6s}{spread}")
    lines += ["", "targets:"]
    for t in result["targets"]:
        lines.append(f"  {'met ' if t['met'] else 'MISS'} {t['row']} vs {t['against']}: "
                     f"{t['ratio']:.2f}x (at most {t['limit']}x)")
    if result["ray"] != "measured":
        lines.append(f"  Ray: {result['ray']}")
    return "\n".join(lines)


def measure(ctx: Any) -> dict[str, Any]:
    # even: each group first as often; 40: a row's turns spread over 0.83-1.33x on the
    # 2-core VM, and one 10-turn run put the same code's 16-float row at 1.03x and 1.08x
    own = ctx.cfg.get(SECTION, {})  # bench.run's SMOKE
    calls, turns = (own.get("calls", 100), own.get("turns", 2)) if ctx.quick else (100, 40)
    ctx.log(f"overhead: torch-only and rpcnb groups in turns, {calls} calls, {turns} turns")
    return measure_turns(calls, turns)


def report(section: dict[str, Any], results: dict[str, Any]) -> Any:
    from bench.report import Part, target

    part = Part(title="What rpcnb costs plain torch RPC calls")
    rows = [["call", "torch ms", "rpcnb ms", "ratio", "turns"]]
    for r in section["rows"]:
        if "ray_ms" in r:
            rows.append([r["call"], "", f"{r['ray_ms']:.3f} (Ray)", "", ""])
            continue
        if "floor_ms" in r:
            rows.append([r["call"], "", f"{r['floor_ms']:.3f} (floor)", "", ""])
            continue
        t, spread = r["torch_ms"], r.get("turn_ratios")
        rows.append([r["call"], "" if t is None else f"{t:.3f}", f"{r['rpcnb_ms']:.3f}",
                     "" if t is None else f"{r['rpcnb_ms'] / t:.2f}x",
                     f"{spread[0]:.2f}-{spread[2]:.2f}x" if spread else ""])
    part.tables.append((f"medians of {section['turns']} turns of {section['calls']} calls, groups "
                        "of two on one host started by torch's init_rpc and by rpcnb.init(1), "
                        "TensorPipe uv on loopback (bench/overhead.py)", rows))
    for t in section["targets"]:
        part.targets.append(target(f"{t['row']} <= {t['limit']:g}x {t['against']}", t["ratio"],
                                   t["limit"], t["met"], f"{t['ratio']:.2f}x"))
    return part


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "overhead.json"))
    args = ap.parse_args(argv)
    from importlib.metadata import PackageNotFoundError, version

    from bench.run import machine  # the machine's facts, as make bench's JSON has them

    info = machine()
    try:
        info["ray"] = version("ray")
    except PackageNotFoundError:
        info["ray"] = None
    t0 = time.monotonic()
    result = measure_turns(args.calls, args.turns)
    result["seconds"] = round(time.monotonic() - t0, 1)
    info["loadavg_end"] = list(os.getloadavg())
    result["machine"] = info  # docs/benchmarks.md's table names it (scripts/bench_table.py)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
