"""Where the time of rpcnb's 100 MB CUDA round trip goes, on a GPU machine: the round trip
of ``bench/gpu.py`` split into its parts, in turns in one run (15 turns, medians).

    python -m bench.gpu_split        # needs a CUDA device; prints one line per way

Rows: raw ``rpc_sync`` of an identity function (the tensor there and back) and of a
function that returns None (one way); ``rpcnb.run`` with ``push`` only, with ``fetch``
only (of a tensor already on the worker), with both, and a no-op. It writes no JSON: the
figures measured on one H100 are in the git history of docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

MB100 = 100 * 2**20 // 4  # float32 elements in 100 MB


def identity(t: Any) -> Any:
    return t


def sink(t: Any) -> None:
    return None


def main() -> int:
    import torch
    import torch.distributed.rpc as rpc

    import rpcnb

    if not torch.cuda.is_available():
        print("gpu_split: no CUDA device here: nothing to measure")
        return 0
    rpcnb.init(1, device_map={"worker1": {"cuda:0": "cuda:0"}})
    try:
        t = torch.randn(MB100, device="cuda:0")
        rpcnb.run("worker1", f"import torch\nkept = torch.randn({MB100}, device='cuda:0')")
        ways = {
            "raw identity": lambda: rpc.rpc_sync("worker1", identity, args=(t,)),
            "raw one-way": lambda: rpc.rpc_sync("worker1", sink, args=(t,)),
            "rpcnb push only": lambda: rpcnb.run("worker1", "None", push={"t": t}, fetch=True),
            "rpcnb fetch only": lambda: rpcnb.run("worker1", "kept", fetch=True),
            "rpcnb push+fetch": lambda: rpcnb.run("worker1", "t", push={"t": t}, fetch=True),
            "rpcnb noop": lambda: rpcnb.run("worker1", "None", fetch=True),
        }
        res: dict[str, list[float]] = {k: [] for k in ways}
        for fn in ways.values():  # warm-up
            fn()
        for _ in range(15):
            for k, fn in ways.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                res[k].append((time.perf_counter() - t0) * 1e3)
        for k, v in res.items():
            print(f"{k:20s} {statistics.median(v):8.2f} ms", flush=True)
    finally:
        rpcnb.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
