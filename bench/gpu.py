"""The CUDA benchmark, side by side in one run (issue "CUDA RPC on a real GPU machine").

    python -m bench.gpu [--out PATH] [--size-mb 100] [--reps 20]

1. A CUDA tensor (100 MB) round trip worker0 -> worker1 -> worker0, three ways taking
   turns: rpcnb (``rpcnb.run("worker1", "t", push={"t": t}, fetch=True)``: ``--push``
   then ``--fetch`` of the same tensor), raw ``rpc.rpc_sync`` of an identity function
   with the same device map, and staged through CPU (``.cpu()`` before sending, back to
   the GPU on arrival, as without a device map).
2. Where CuPy is installed, ``--push`` of a CuPy array of the same size to ``worker1``
   (``rpcnb.run("worker1", "None", push={"a": a})``) against the same push of the CUDA
   tensor, and against the CuPy array pickled (``rpcnb.paths.arrays.set_enabled(False)``: as
   torch RPC sends it without rpcnb, through the host), in turns.
3. The PyTorch CUDA RPC recipe's ``measure`` (two ``Linear(1000, 1000)`` shards,
   distributed autograd, ten iterations) in ``comm_mode="cpu"`` and ``"cuda"``, its
   ``MyModule`` defined in ``__main__`` (shipped by value, as from a notebook cell); then
   the same recipe in a group formed by torch's own ``init_rpc`` (``bench/gpu_recipe.py``,
   the recipe's options and map): does an rpcnb group tax it?

With one GPU both processes use ``cuda:0`` (map ``{0: 0}``: CUDA IPC between processes);
with two, the recipe's ``cuda:0`` -> ``cuda:1`` (``{0: 1}``). Without CUDA it says so and
exits 0. Prints a table and writes JSON (every sample, the machine, the verdicts).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "bench" / "results" / "gpu.json"
TARGETS = {
    "rpcnb round trip within 1.5x of raw rpc_sync (same map)": ("rpcnb", "raw", 1.5),
    "rpcnb round trip at least 25x faster than CPU-staged": ("staged", "rpcnb", 25.0),
    "recipe: CUDA mode at least 4x faster than CPU mode": ("recipe cpu", "recipe cuda", 4.0),
    "recipe, CUDA mode: rpcnb within 1.05x of torch alone": (
        "recipe cuda", "recipe cuda, torch alone", 1.05),
}
# the ways whose ratio to the other must stay under the target (the rest: above it)
LOWER_IS_BETTER = {"rpcnb", "push cupy", "recipe cuda"}
RECIPE_TURNS = 5
CUPY_TARGET = {
    "CuPy array --push within 1.5x of a CUDA tensor's": ("push cupy", "push tensor", 1.5),
}


def identity(t: Any) -> Any:
    return t


def staged_back(t: Any, device: str) -> Any:
    """On worker1: what a program without a device map does (H2D, work, D2H)."""
    return t.to(device).cpu()


# -- the recipe's code, as pasted into a notebook (defined in __main__ when run as a script)

def recipe_classes() -> Any:
    """The recipe's ``measure`` with its ``MyModule`` defined in ``__main__``, as a notebook
    cell defines it (rpcnb ships it by value): bench/gpu_recipe.py's class, its source run
    again there; that file runs the same recipe in a group of torch alone."""
    import functools
    import inspect

    import torch.nn as nn

    from bench import gpu_recipe

    cell: dict[str, Any] = {"__name__": "__main__", "nn": nn, "Any": Any}
    exec(inspect.getsource(gpu_recipe.MyModule), cell)  # noqa: S102 (the bench's own code)
    return functools.partial(gpu_recipe.measure, cell["MyModule"])


def torch_alone_recipe(local: str, remote: str, turns: int) -> dict[str, list[float]]:
    """The same recipe in a group of two formed by torch's own ``init_rpc`` (the recipe's
    options and map), run after the rpcnb group has shut down: seconds per ``measure``."""
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run([sys.executable, "-m", "bench.gpu_recipe", "--local", local,
                           "--remote", remote, "--turns", str(turns)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the recipe in a group of torch alone failed (exit "
                           f"{done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return {"recipe cpu, torch alone": got["cpu"], "recipe cuda, torch alone": got["cuda"]}


def cupy_pushes(t: Any, reps: int) -> dict[str, list[float]]:
    """One-way pushes of ``t`` and of a CuPy array of the same size, in turns (none
    without CuPy)."""
    try:
        import cupy
    except ImportError:
        print("CuPy is not installed: the CuPy push is not measured")
        return {}
    import torch

    import rpcnb
    from rpcnb.paths import arrays

    with cupy.cuda.Device(t.device.index):
        a = cupy.random.random(t.numel(), dtype=cupy.float32)
    ways = {"push tensor": (t, True), "push cupy": (a, True), "push cupy pickled": (a, False)}
    samples: dict[str, list[float]] = {way: [] for way in ways}

    def once(way: str) -> float:
        value, enabled = ways[way]
        arrays.set_enabled(enabled)
        torch.cuda.synchronize(t.device)
        t0 = time.perf_counter()
        assert rpcnb.run("worker1", "None", push={"a": value}, fetch=True) is None
        return time.perf_counter() - t0

    try:
        for way in ways:
            once(way)  # warm-up
        for _ in range(reps):
            for way in ways:
                samples[way].append(once(way))
        kind = rpcnb.run("worker1", "(type(a).__module__, str(a.device))", push={"a": a},
                         fetch=True)
        assert kind[0] == "cupy", kind  # arrived as a CuPy array
    finally:
        arrays.set_enabled(True)
    return samples


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def run(size_mb: int, reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed.rpc as rpc

    import rpcnb

    gpus = torch.cuda.device_count()
    local, remote = ("cuda:0", "cuda:1") if gpus >= 2 else ("cuda:0", "cuda:0")
    rpcnb.init(1, device_map={"worker1": {local: remote}})
    try:
        t = torch.randn(size_mb * 2**20 // 4, device=local)
        samples: dict[str, list[float]] = {"rpcnb": [], "raw": [], "staged": []}

        def timed(fn: Any) -> float:
            torch.cuda.synchronize(local)
            t0 = time.perf_counter()
            back = fn()
            torch.cuda.synchronize(local)
            dt = time.perf_counter() - t0
            assert back.device == t.device and back.shape == t.shape
            return dt

        ways = {
            "rpcnb": lambda: rpcnb.run("worker1", "t", push={"t": t}, fetch=True),
            "raw": lambda: rpc.rpc_sync("worker1", identity, args=(t,)),
            "staged": lambda: rpc.rpc_sync("worker1", staged_back,
                                           args=(t.cpu(), remote)).to(local),
        }
        for fn in ways.values():  # warm-up: pipes, CUDA IPC handles, allocator
            timed(fn)
        for _ in range(reps):
            for way, fn in ways.items():  # in turns
                samples[way].append(timed(fn))
        samples.update(cupy_pushes(t, reps))
        measure = recipe_classes()
        recipe: dict[str, list[float]] = {"recipe cpu": [], "recipe cuda": []}
        for _ in range(RECIPE_TURNS):
            recipe["recipe cpu"].append(measure("cpu", local, remote))
            recipe["recipe cuda"].append(measure("cuda", local, remote))
    finally:
        rpcnb.shutdown()
    recipe.update(torch_alone_recipe(local, remote, RECIPE_TURNS))
    medians = {k: _median_ms(v) for k, v in {**samples, **recipe}.items()}
    verdicts = {}
    targets = {**TARGETS, **(CUPY_TARGET if "push cupy" in medians else {})}
    for name, (slow, fast, factor) in targets.items():
        ratio = medians[slow] / medians[fast]
        ok = ratio <= factor if slow in LOWER_IS_BETTER else ratio >= factor
        verdicts[name] = {"ratio": ratio, "pass": ok}
    return {
        "machine": {"gpus": gpus, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "python": platform.python_version(), "map": f"{local} -> {remote}"},
        "size_mb": size_mb, "samples_s": {**samples, **recipe}, "median_ms": medians,
        "targets": verdicts,
    }


def table(result: dict[str, Any]) -> str:
    m = result["median_ms"]
    rows = [
        (f"{result['size_mb']} MB CUDA round trip ({result['machine']['map']})", "", ""),
        ("  rpcnb --push/--fetch", f"{m['rpcnb']:.2f} ms", ""),
        ("  raw rpc_sync, same map", f"{m['raw']:.2f} ms", f"rpcnb/raw {m['rpcnb'] / m['raw']:.2f}x"),
        ("  staged through CPU", f"{m['staged']:.2f} ms", f"staged/rpcnb {m['staged'] / m['rpcnb']:.1f}x"),
        *([(f"{result['size_mb']} MB one-way --push", "", ""),
           ("  CUDA tensor", f"{m['push tensor']:.2f} ms", ""),
           ("  CuPy array", f"{m['push cupy']:.2f} ms",
            f"cupy/tensor {m['push cupy'] / m['push tensor']:.2f}x"),
           ("  CuPy array pickled", f"{m['push cupy pickled']:.2f} ms",
            f"pickled/cupy {m['push cupy pickled'] / m['push cupy']:.1f}x")]
          if "push cupy" in m else []),
        ("recipe, 10 iterations", "", ""),
        ("  comm_mode='cpu'", f"{m['recipe cpu']:.1f} ms", ""),
        ("  comm_mode='cuda'", f"{m['recipe cuda']:.1f} ms",
         f"speed-up {m['recipe cpu'] / m['recipe cuda']:.1f}x"),
        ("recipe, 10 iterations, group of torch alone", "", ""),
        ("  comm_mode='cpu'", f"{m['recipe cpu, torch alone']:.1f} ms",
         f"rpcnb/torch {m['recipe cpu'] / m['recipe cpu, torch alone']:.2f}x"),
        ("  comm_mode='cuda'", f"{m['recipe cuda, torch alone']:.1f} ms",
         f"rpcnb/torch {m['recipe cuda'] / m['recipe cuda, torch alone']:.2f}x; speed-up "
         f"{m['recipe cpu, torch alone'] / m['recipe cuda, torch alone']:.1f}x"),
    ]
    from rpcnb.text import table as render

    lines = [render([("measure", "median", "ratio"), *rows]), ""]
    for name, v in result["targets"].items():
        lines.append(f"{'PASS' if v['pass'] else 'MISS'}  {name}: {v['ratio']:.2f}x")
    lines.append(f"({result['machine']['gpu']}, {result['machine']['gpus']} GPU(s), "
                 f"torch {result['machine']['torch']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.gpu")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--size-mb", type=int, default=100)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"no CUDA device here (torch {torch.__version__} sees none): the GPU "
              "benchmark needs one, nothing was measured")
        return 0
    result = run(args.size_mb, args.reps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
