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
   ``MyModule`` defined in ``__main__`` (shipped by value, as from a notebook cell).

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
}
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
    import torch
    import torch.distributed.autograd as autograd
    import torch.distributed.rpc as rpc
    import torch.nn as nn

    class MyModule(nn.Module):
        def __init__(self, device: str, comm_mode: str) -> None:
            super().__init__()
            self.device = device
            self.linear = nn.Linear(1000, 1000).to(device)
            self.comm_mode = comm_mode

        def forward(self, x: Any) -> Any:
            y = self.linear(x.to(self.device))
            return y.cpu() if self.comm_mode == "cpu" else y

    MyModule.__module__ = "__main__"  # as a class defined in a notebook cell

    def measure(comm_mode: str, local: str, remote: str) -> float:
        lm = MyModule(local, comm_mode)
        rm = rpc.remote("worker1", MyModule, args=(remote, comm_mode))
        x = torch.randn(1000, 1000).to(local)
        tik = time.time()
        for _ in range(10):
            with autograd.context() as ctx:
                y = rm.rpc_sync().forward(lm(x))
                autograd.backward(ctx, [y.sum()])
        torch.cuda.current_stream(local).synchronize()
        return time.time() - tik

    return measure


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
        recipe = {"recipe cpu": [], "recipe cuda": []}
        for _ in range(3):
            recipe["recipe cpu"].append(measure("cpu", local, remote))
            recipe["recipe cuda"].append(measure("cuda", local, remote))
    finally:
        rpcnb.shutdown()
    medians = {k: _median_ms(v) for k, v in {**samples, **recipe}.items()}
    verdicts = {}
    targets = {**TARGETS, **(CUPY_TARGET if "push cupy" in medians else {})}
    for name, (slow, fast, factor) in targets.items():
        ratio = medians[slow] / medians[fast]
        ok = ratio <= factor if slow in ("rpcnb", "push cupy") else ratio >= factor
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
