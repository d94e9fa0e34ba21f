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
   the same recipe in an rpcnb group with TensorPipe's shm transport (``--transports
   shm,uv``), and in groups formed by torch's own ``init_rpc`` (``bench/gpu_recipe.py``, the
   recipe's options and map) over uv only and with torch's default transports: does an
   rpcnb group tax it, and what does rpcnb's default transport cost?

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

from bench import python_path  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "results" / "gpu.json"
TARGETS = {
    "rpcnb round trip within 1.5x of raw rpc_sync (same map)": ("rpcnb", "raw", 1.5),
    "rpcnb round trip at least 25x faster than CPU-staged": ("staged", "rpcnb", 25.0),
    "recipe: CUDA mode at least 4x faster than CPU mode": ("recipe cpu", "recipe cuda", 4.0),
    "recipe, CUDA mode: rpcnb within 1.05x of torch alone, both over uv": (
        "recipe cuda", "recipe cuda, torch uv", 1.05),
    "recipe, CUDA mode: rpcnb --transports shm,uv within 1.05x of torch's defaults": (
        "recipe cuda, rpcnb shm", "recipe cuda, torch", 1.05),
}
# the ways whose ratio to the other must stay under the target (the rest: above it)
LOWER_IS_BETTER = {"rpcnb", "push cupy", "recipe cuda", "recipe cuda, rpcnb shm"}
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


def torch_alone_recipe(local: str, remote: str, turns: int,
                       transports: str = "") -> dict[str, list[float]]:
    """The same recipe in a group of two formed by torch's own ``init_rpc`` (the recipe's
    options and map; ``transports`` "" for torch's own, shm and uv), run while no rpcnb
    group is up: seconds per ``measure``, keyed "cpu" and "cuda"."""
    import os
    import subprocess

    done = subprocess.run([sys.executable, "-m", "bench.gpu_recipe", "--local", local,
                           "--remote", remote, "--turns", str(turns), "--transports",
                           transports], cwd=ROOT, env=dict(os.environ, PYTHONPATH=python_path()),
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the recipe in a group of torch alone failed (exit "
                           f"{done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    got: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return got


def rpcnb_recipe(local: str, remote: str, turns: int, **init: Any) -> dict[str, list[float]]:
    """The recipe, pasted, in an rpcnb group started with ``init`` (and the map)."""
    import rpcnb

    rpcnb.init(1, device_map={"worker1": {local: remote}}, **init)
    try:
        measure = recipe_classes()
        got: dict[str, list[float]] = {"cpu": [], "cuda": []}
        for _ in range(turns):
            for mode in got:
                got[mode].append(measure(mode, local, remote))
        return got
    finally:
        rpcnb.shutdown()


# the recipe's groups: rpcnb as it starts (--transports uv), rpcnb with TensorPipe's shm
# transport too, and torch alone with each of those: (key suffix, runner, its argument)
RECIPE_GROUPS = [
    ("", "rpcnb", {}),
    (", rpcnb shm", "rpcnb", {"transports": ["shm", "uv"]}),
    (", torch uv", "torch", "uv"),
    (", torch", "torch", ""),
]


def recipes(local: str, remote: str, turns: int) -> dict[str, list[float]]:
    """Every group of RECIPE_GROUPS in turn, one after the other: ``recipe cpu<suffix>``
    and ``recipe cuda<suffix>`` samples (seconds)."""
    out: dict[str, list[float]] = {}
    for suffix, who, arg in RECIPE_GROUPS:
        got = (rpcnb_recipe(local, remote, turns, **arg) if who == "rpcnb"  # type: ignore[arg-type]
               else torch_alone_recipe(local, remote, turns, arg))  # type: ignore[arg-type]
        out.update({f"recipe {mode}{suffix}": xs for mode, xs in got.items()})
    return out


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
    finally:
        rpcnb.shutdown()
    recipe = recipes(local, remote, RECIPE_TURNS)
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


# (label, key suffix, the suffix of the torch group it is compared with)
RECIPE_ROWS = [
    ("rpcnb (--transports uv)", "", ", torch uv"),
    ("rpcnb --transports shm,uv", ", rpcnb shm", ", torch"),
    ("torch alone, _transports=['uv']", ", torch uv", None),
    ("torch alone, its defaults (shm, uv)", ", torch", None),
]


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
        ("recipe, 10 iterations (cpu / cuda mode)", "", ""),
        *[(f"  {label}", f"{m['recipe cpu' + suffix]:.1f} / {m['recipe cuda' + suffix]:.1f} ms",
           f"speed-up {m['recipe cpu' + suffix] / m['recipe cuda' + suffix]:.1f}x"
           + (f"; cuda: rpcnb/torch {m['recipe cuda' + suffix] / m['recipe cuda' + base]:.2f}x"
              if base is not None else ""))
          for label, suffix, base in RECIPE_ROWS],
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
