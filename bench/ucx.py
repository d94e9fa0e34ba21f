"""The UCX path side by side with TensorPipe (uv) and rpcnb's shared memory: one-way CPU
tensors of 10 MB to 512 MB from this process to a worker, in one run.

    .venv/bin/python -m bench.ucx               # -> bench/results/ucx.json, and a table
    .venv/bin/python -m bench.ucx --quick       # 10 and 100 MB, 3 repetitions

Each path is a fresh group (``rpcnb.init(1, ...)``) in this process; a send is rpcnb's
``probe_sink`` request (the tensor as its argument), timed until the worker has the
tensor and answered. Medians of the repetitions after one warm-up; ratios are UCX's time
over the other path's (below 1: UCX is faster). ``--netns`` runs a second process in a
network namespace joined by a veth pair (``rpcnb.netns``' test fixture's setup) when the
machine allows it, else it says why not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MB = 1 << 20
PATHS = {  # name -> rpcnb.init keywords
    "tensorpipe_uv": {"shm": False},
    "rpcnb_shm": {"shm": True},
    "ucx": {"shm": False, "ucx": True},
}


def time_path(kwargs: dict[str, Any], sizes: list[int], reps: int) -> dict[str, Any]:
    import torch

    import rpcnb
    from rpcnb import protocol, state, ucx

    rpcnb.init(1, **kwargs)
    try:
        s = state.current()
        out: dict[str, Any] = {}
        for mb in sizes:
            t = torch.ones(mb * MB // 4)
            samples = []
            for i in range(reps + 1):
                t0 = time.perf_counter()
                got = protocol.call(s.token, "worker1", "probe_sink", t, timeout=None)
                dt = time.perf_counter() - t0
                assert got == mb * MB, got
                if i:  # the first one opens connections and endpoints
                    samples.append(dt)
            out[str(mb)] = {"median_ms": statistics.median(samples) * 1e3,
                            "samples_ms": [round(x * 1e3, 2) for x in samples]}
        if kwargs.get("ucx"):
            out["ucx_transport"] = ucx.transports().get("worker1", "?")
        return out
    finally:
        rpcnb.shutdown()


def table(results: dict[str, Any], sizes: list[int]) -> str:
    rows = [["MB", "TensorPipe uv", "rpcnb shm", "UCX", "UCX/uv", "UCX/shm", "UCX GB/s"]]
    for mb in sizes:
        k = str(mb)
        uv, sh, u = (results[p][k]["median_ms"] for p in ("tensorpipe_uv", "rpcnb_shm", "ucx"))
        rows.append([k, f"{uv:.1f} ms", f"{sh:.1f} ms", f"{u:.1f} ms", f"{u / uv:.2f}",
                     f"{u / sh:.2f}", f"{mb * MB / (u / 1e3) / 1e9:.2f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ucx.json"))
    args = ap.parse_args(argv)
    sizes = [10, 100] if args.quick else [10, 50, 100, 256, 512]
    reps = 3 if args.quick else 5
    try:
        import ucxx  # noqa: F401
    except ImportError:
        print("bench.ucx: the ucx extra is not installed: pip install 'rpcnb[ucx]'",
              file=sys.stderr)
        return 2
    results: dict[str, Any] = {"sizes_mb": sizes, "repetitions": reps,
                               "cpus": os.cpu_count(), "host": "one host, loopback"}
    for name, kwargs in PATHS.items():
        print(f"bench.ucx: {name} ...", file=sys.stderr, flush=True)
        results[name] = time_path(kwargs, sizes, reps)
    text = table(results, sizes)
    results["table"] = text
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(text)
    print(f"UCX transport on one host: {results['ucx'].get('ucx_transport')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
