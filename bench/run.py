"""rpcnb's benchmarks, each comparison side by side in one run; prints a table, writes JSON.

    .venv/bin/python -m bench.run            # full run -> bench/results/latest.json
    .venv/bin/python -m bench.run --quick    # smoke run, well under a minute
    .venv/bin/python -m bench.run --smoke    # the test suite's: each comparison once, tiny
    .venv/bin/python bench/run.py --out PATH

What runs (docs/benchmarks.md says more):

1. no-op round trip from a notebook kernel: raw ``rpc.rpc_sync``, ``rpcnb.run``,
   ``%%remote``, ipyparallel's ``apply_sync`` and ``%%px``;
2. one-way CPU tensor to a worker: TensorPipe, rpcnb's shared-memory path, memcpy;
3. ``%%remote`` fan-out of a no-op to 1, 2, 4, 8 workers;
4. fresh kernel to first remote result, in parts: ``%rpc_init --workers 2`` against an
   ipyparallel cluster of 2 engines (the cold runs of ``bench.startup``, made once).

Timed loops run inside real IPython kernels (``bench.in_kernel``), driven through
jupyter_client with the tests' ``Kernel`` class. Every process started here is stopped
at the end, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/run.py` puts bench/ first, not the root
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import Kernel, children_of, kill_all, pid_alive  # noqa: E402

from bench import python_path  # noqa: E402
from bench.in_kernel import MARK  # noqa: E402
from bench.tables import MODULES, report  # noqa: E402
from bench.ucx import section as ucx_section  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "results" / "latest.json"



@dataclass
class Context:
    """What a bench module's ``measure(ctx)`` gets: the settings and the helpers."""

    quick: bool
    rpc_args: str
    cfg: dict[str, Any]
    log: Callable[[str], None]
    cell: Callable[..., Any]
    new_kernel: Callable[[], Any]
    close_kernel: Callable[[Any, list[str]], None]
    children_of: Callable[[int], list[int]]


def modules() -> list[Any]:
    import importlib

    found = []
    for name in MODULES:
        try:
            found.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
    return found

FULL = {
    "workers": 8,
    "fanout": [1, 2, 4, 8],
    "rt": {"calls": 10, "rounds": 25, "warmup": 10},
    "cells": {"cells": 10, "rounds": 6},
    "fan": {"calls": 10, "rounds": 10, "warmup": 5},
    "sizes_mb": [1, 10, 100, 512],
    "reps": {"1": 20, "10": 10, "100": 5, "512": 5},
    "xfer_warmup": 2,
    "startup_reps": 3,
}
QUICK = {
    "workers": 4,
    "fanout": [1, 2, 4],
    "rt": {"calls": 5, "rounds": 3, "warmup": 3},
    "cells": {"cells": 5, "rounds": 1},
    "fan": {"calls": 5, "rounds": 2, "warmup": 2},
    "sizes_mb": [1, 10],
    "reps": {"default": 5},
    "xfer_warmup": 1,
    "startup_reps": 1,
}
# tests/kernel/test_bench_smoke.py: every comparison of a quick run, each at the smallest
# counts that still give every figure and table, so that the run is its processes' start-ups
# (the UCX section, a process of its own, is left out). The bench modules take their part
# by their SECTION name; what a part does not name is their --quick setting.
SMOKE = {
    "workers": 2,
    "fanout": [1, 2],
    "rt": {"calls": 2, "rounds": 1, "warmup": 1},
    "cells": {"cells": 1, "rounds": 1},
    "fan": {"calls": 2, "rounds": 1, "warmup": 1},
    "sizes_mb": [1],
    "reps": {"default": 2},
    "xfer_warmup": 0,
    "startup_reps": 1,
    "curves": {"sizes": [4 << 10, 256 << 10], "reps": 1, "warmup": 0},
    "idle": {"seconds": 1.0, "workers": 2},
    "startup_cold_warm": {"warm": 1},
    "notebook_code": {"rounds": 1, "steps": 5},
    "overhead": {"calls": 10, "turns": 2},
}


# --------------------------------------------------------------------------- kernels


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cell(k: Kernel, code: str, timeout: float = 300) -> Any:
    """Run ``code`` in ``k`` and return the JSON it emitted (``bench.in_kernel.emit``).

    Waits on the kernel's messages without the tests' /proc scan every 0.1 s, which would
    compete with the timed loop for the machine's cores; descendants are recorded after.
    """
    stdout: list[str] = []
    errors: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            (stdout if content["name"] == "stdout" else errors).append(content["text"])
        elif kind == "error":
            errors.append("\n".join(content["traceback"]))

    try:
        reply = k.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    finally:
        k.known.update(children_of(k.pid))
    text = "".join(stdout)
    if reply["content"]["status"] != "ok" or "UsageError" in "".join(errors):
        raise RuntimeError(f"cell failed: {code[:120]!r}\n{''.join(errors)[-3000:]}\n{text[-2000:]}")
    for line in reversed(text.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return None


def new_kernel() -> Kernel:
    k = Kernel()
    k.known.update(children_of(k.pid))
    cell(k, "import bench.in_kernel as B")
    return k


def close_kernel(k: Kernel, stop: list[str]) -> None:
    """Run the stop cells (best effort, bounded), then shut the kernel down and kill by pid."""
    for code in stop:
        try:
            cell(k, code, timeout=60)
        except Exception as exc:
            log(f"cleanup cell failed ({code!r}): {str(exc)[:300]}")
    k.close()


# --------------------------------------------------------------------------- statistics


def summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    n = len(s)
    return {
        "median_ms": statistics.median(s) * 1e3,
        "p10_ms": s[int(0.1 * (n - 1))] * 1e3,
        "p90_ms": s[int(0.9 * (n - 1))] * 1e3,
        "n": n,
    }


def rounded(samples: list[float]) -> list[float]:
    return [round(x * 1e3, 4) for x in samples]  # ms, 0.1 us resolution


# --------------------------------------------------------------------------- the runs


def stats_of(raw: dict[str, list[float]]) -> dict[str, Any]:
    return {name: {**summary(v), "samples_ms": rounded(v)} for name, v in raw.items()}


def run_roundtrip_kernel(cfg: dict[str, Any], results: dict[str, Any], rpc_args: str,
                         parts: set[str]) -> None:
    """Benchmarks 1 and 2 in one kernel: worker0 of a group of 2 workers, plus a cluster.

    Idle TensorPipe processes busy-poll their shared-memory transport, so the rpcnb group
    slows everything else on a small machine. ipyparallel is therefore timed twice: side by
    side with rpcnb (same conditions for both) and once more after the group has left
    (ipyparallel's own conditions). Idle ipyparallel processes use no CPU.
    """
    log("kernel + %rpc_init --workers 2 + ipyparallel cluster (2 engines)")
    k = new_kernel()
    stop = ["B.stop_ipp()", "B.stop_rpcnb()"]
    try:
        cell(k, "%load_ext rpcnb")
        cell(k, f"%rpc_init --workers 2 {rpc_args}".strip(), timeout=300)
        results["torch_threads_in_kernel"] = cell(k, "B.emit(B.torch_threads())")
        if "1" in parts:
            cell(k, "B.emit(B.start_ipp(2))", timeout=300)

        rt = cfg["rt"]
        args = f"{rt['calls']}, {rt['rounds']}, {rt['warmup']}"
        if "1" in parts:
            log("1. no-op round trip (timed in the kernel)")
            results["roundtrip"] = stats_of(cell(k, f"B.emit(B.roundtrip(B._state['rc'], {args}))"))
            log("1b. the same as whole cells sent by a front end (execute request to idle)")
            results["roundtrip_cells"] = time_cells(k, cfg["cells"])
        if "2" in parts:
            run_transfer(k, cfg, results)
        if "1" in parts:
            log("1c. ipyparallel again, after the rpcnb group has left")
            cell(k, "B.stop_rpcnb()", timeout=120)
            time.sleep(1.0)
            alone = stats_of(cell(k, f"B.emit(B.roundtrip(B._state['rc'], {args}, rpcnb_up=False))"))
            results["roundtrip_ipp_alone"] = alone
    finally:
        close_kernel(k, stop)


def run_transfer(k: Kernel, cfg: dict[str, Any], results: dict[str, Any]) -> None:
    log(f"2. one-way tensor transfer {cfg['sizes_mb']} MB")
    raw = cell(k, f"B.emit(B.transfer({cfg['sizes_mb']!r}, {cfg['reps']!r}, {cfg['xfer_warmup']}))",
               timeout=600)
    sizes = {}
    for mb, entry in raw["sizes"].items():
        sizes[mb] = {"bytes": entry["bytes"], "shm_sends": entry["shm_sends"],
                     **stats_of(entry["samples"])}
    results["transfer"] = {"shm": raw["shm"], "shm_active": raw["shm_active"],
                           "shm_stats": raw.get("shm_stats"), "sizes": sizes}


def run_fanout_kernel(cfg: dict[str, Any], results: dict[str, Any], rpc_args: str) -> None:
    """Benchmark 3 in a kernel that is worker0 of one group of cfg['workers'] workers."""
    log(f"kernel + %rpc_init --workers {cfg['workers']}")
    k = new_kernel()
    try:
        cell(k, "%load_ext rpcnb")
        cell(k, f"%rpc_init --workers {cfg['workers']} {rpc_args}".strip(), timeout=300)
        log(f"3. fan-out to {cfg['fanout']} workers")
        f = cfg["fan"]
        raw = cell(k, f"B.emit(B.fanout({cfg['fanout']!r}, {f['calls']}, {f['rounds']}, {f['warmup']}))")
        results["fanout"] = stats_of(raw)
    finally:
        close_kernel(k, ["B.stop_rpcnb()"])


def time_cells(k: Kernel, cfg: dict[str, int]) -> dict[str, Any]:
    """Wall time of whole cells as a front end sees them: execute request to idle."""
    codes = {
        "empty cell": "pass",
        "cell sleeping 1 ms": "__import__('time').sleep(0.001)",
        "%%remote": "%%remote worker1\nNone",
        "%%px": "%%px\npass",
    }
    for code in codes.values():  # warm-up
        k.kc.execute_interactive(code, timeout=60, output_hook=lambda m: None)
    samples: dict[str, list[float]] = {name: [] for name in codes}
    names = list(codes)
    for r in range(cfg["rounds"]):
        j = r % len(names)
        for name in names[j:] + names[:j]:
            for _ in range(cfg["cells"]):
                t0 = time.perf_counter()
                reply = k.kc.execute_interactive(codes[name], timeout=60, output_hook=lambda m: None)
                samples[name].append(time.perf_counter() - t0)
                if reply["content"]["status"] != "ok":
                    raise RuntimeError(f"cell {codes[name]!r} failed: {reply['content']}")
    return stats_of(samples)


STARTUP = "startup_cold_warm"  # bench.startup's SECTION: section 4 shows its cold runs


def run_startup(results: dict[str, Any]) -> None:
    """Benchmark 4: a fresh kernel each time, to the first result, in parts: the cold runs
    of bench.startup (rpcnb and ipyparallel in turns), which runs before it."""
    if STARTUP not in results:
        raise RuntimeError(f"no start-up runs to show: the {STARTUP} section failed (above)")
    parts = results[STARTUP]["parts"]
    out = {"rpcnb": parts["rpcnb cold"], "ipyparallel": parts["ipyparallel"]}
    results["startup"] = {
        which: {
            "runs": runs,
            **{f"{key}_median": statistics.median(run[key] for run in runs)
               for key in ("load_s", "init_s", "first_result_s", "total_s")},
        }
        for which, runs in out.items()
    }


# --------------------------------------------------------------------------- machine


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass

    def version(mod: str) -> str | None:
        try:
            from importlib.metadata import version as v

            return v(mod)
        except Exception:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "rpcnb"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except Exception:
        commit, dirty = "", False
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "mem_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "ipyparallel": version("ipyparallel"),
        "ipykernel": version("ipykernel"),
        "rpcnb": version("rpcnb"),
        "git_commit": commit,
        "rpcnb_tree_dirty": dirty,
        "loadavg_start": list(os.getloadavg()),
    }


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and repeats: a smoke run")
    parser.add_argument("--smoke", action="store_true",
                        help="each comparison once at the smallest counts, no UCX section: "
                             "the test suite's run (tests/kernel/test_bench_smoke.py)")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON path (default {DEFAULT_OUT})")
    parser.add_argument("--only", default=None,
                        help="comma list of benchmarks to run: 1,2,3,4 and the modules' sections "
                             "(curves, idle, ...) and ucx; 1 and 2 share a kernel (default all)")
    parser.add_argument("--rpc-args", default="",
                        help="extra %%rpc_init flags for every rpcnb group, e.g. '--transports uv'")
    args = parser.parse_args(argv)
    args.quick = args.quick or args.smoke  # the bench modules' small setting, where SMOKE is silent
    cfg = SMOKE if args.smoke else QUICK if args.quick else FULL
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    extra = modules()
    every = ["1", "2", "3", "4"] + [m.SECTION for m in extra] + ([] if args.smoke else ["ucx"])
    only = {p.strip() for p in (args.only or ",".join(every)).split(",")}
    if "4" in only:
        only.add(STARTUP)  # whose cold runs 4 shows
    out_path = args.out or DEFAULT_OUT

    # Workers and engines start with this environment: they must import bench.targets.
    os.chdir(ROOT)
    os.environ["PYTHONPATH"] = python_path()
    shm_before = set(glob.glob("/dev/shm/rpcnb-*"))

    info = machine()
    results: dict[str, Any] = {}
    t0 = time.monotonic()
    errors: dict[str, str] = {}
    sections = [
        ("1,2", only & {"1", "2"}, lambda: run_roundtrip_kernel(cfg, results, args.rpc_args, only)),
        ("3", "3" in only, lambda: run_fanout_kernel(cfg, results, args.rpc_args)),
    ]
    ctx = Context(args.quick, args.rpc_args, cfg, log, cell, new_kernel, close_kernel, children_of)
    for module in extra:
        sections.append((module.SECTION, module.SECTION in only,
                         lambda m=module: results.__setitem__(m.SECTION, m.measure(ctx))))
    # after bench.startup, whose cold runs it shows in parts
    sections.append(("4", "4" in only, lambda: run_startup(results)))
    interrupted: BaseException | None = None
    left: list[int] = []
    try:
        for label, wanted, section in sections:
            if not wanted:
                continue
            try:
                section()
            except Exception as exc:  # report what was measured, go on with the next one
                errors[label] = re.sub(r"\x1b\[[0-9;]*m", "", f"{type(exc).__name__}: {exc}")
                log(f"benchmark {label} failed: {errors[label][-2000:]}")
    except BaseException as exc:  # Ctrl-C: clean up, write what there is, re-raise
        interrupted = exc
    finally:
        time.sleep(0.2)
        left = [p for p in children_of(os.getpid()) if pid_alive(p)]
        if left:
            log(f"killing leftover processes: {left}")
            kill_all(left)
    info["loadavg_end"] = list(os.getloadavg())
    info["wall_s"] = round(time.monotonic() - t0, 1)
    # new since the start and made by a process of the benchmark's, which have all ended
    # by now (a segment is named rpcnb-GROUP-PID-N): a live group of another program on
    # this machine (a parallel test's) may make segments of its own meanwhile
    leftover_shm = sorted(f for f in set(glob.glob("/dev/shm/rpcnb-*")) - shm_before
                          if not pid_alive(int(f.rsplit("-", 2)[1])))

    table, targets = report(results, cfg)
    from bench import report as generated  # the modules' parts, as the docs show them

    more = []
    for part in generated.parts({"results": results}):
        for caption, rows in part.tables:
            table += f"\n\n{caption}\n{generated.text_table(rows)}"
        more += part.targets
    if more:
        table += "\n\n" + generated.text_table([["goals (start-up)", "verdict", "measured"]] + [
            [t["target"], t["verdict"], t["shown"]] for t in more])
    targets += more
    header = (f"rpcnb benchmarks ({mode}) on {info['cpu_model']} x "
              f"{info['cpus_usable']} cpus, python {info['python']}, torch {info['torch']}, "
              f"ipyparallel {info['ipyparallel']}, {info['date']}, load {info['loadavg_start'][0]:.2f}"
              f" -> {info['loadavg_end'][0]:.2f}" + (f", %rpc_init {args.rpc_args}" if args.rpc_args else ""))
    print(header)
    print()
    print(table)
    for label, err in errors.items():
        print(f"\nbenchmark {label} FAILED: {err[-1500:]}")
    if leftover_shm:
        print(f"\nshared-memory files left in /dev/shm: {leftover_shm}")

    doc = {
        "mode": mode,
        "rpc_args": args.rpc_args,
        "machine": info,
        "config": cfg,
        "results": results,
        "targets": targets,
        "leftover_shm": leftover_shm,
        "left_processes": left,
        "errors": errors,
        "table": header + "\n\n" + table,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {out_path}")
    if interrupted is None and "ucx" in only:  # a process of its own: bench/results/ucx.json
        ucx_section(args.quick)
    if interrupted is not None:
        raise interrupted
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
