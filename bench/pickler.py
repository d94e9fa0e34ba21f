"""What rpcnb's pickler costs per message, in this process (no group, no RPC).

    .venv/bin/python -m bench.pickler [--rounds 30] [--calls 200] [--out PATH]

Times ``serialize`` of torch's RPC pickler (rpcnb's, once installed) on small messages:
calls of an importable function and of a notebook function (defined in ``__main__``),
with no arguments, with a few plain ones, with a small torch tensor and with a small
NumPy array. The methods take turns round by round; the figure is the median of the
per-round means, in microseconds. Run it on two trees (``PYTHONPATH=OTHER_TREE``) to
compare a change of the pickler side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NOTEBOOK_CODE = """
import torch

def nb_add(a, b=1):
    return a + b

def nb_call_method(method, obj, *args):
    return method(obj, *args)

class NbAgent:
    def select_action(self, ob_id, state):
        return int(torch.argmax(state))
"""


def messages() -> dict[str, Any]:
    import numpy as np
    import torch
    from torch.distributed.rpc.internal import PythonUDF

    from bench.targets import noop

    main = sys.modules["__main__"].__dict__
    exec(NOTEBOOK_CODE, main)  # as if defined in a notebook cell
    nb_add = main["nb_add"]
    small = {"step": 3, "name": "agent", "values": [1.0, 2.0, 3.0]}
    return {
        "importable, no args": PythonUDF(noop, (), {}),
        "notebook fn, small args": PythonUDF(nb_add, (41,), {"b": small["step"]}),
        # the tutorials' _call_method(Agent.select_action, ...), pasted into a notebook
        "notebook fn, notebook method + tensor": PythonUDF(
            main["nb_call_method"], (main["NbAgent"].select_action, 3, torch.zeros(4)), {}),
        "importable, dict of plain values": PythonUDF(noop, (small,), {}),
        "importable, 1 KB torch tensor": PythonUDF(noop, (torch.ones(256),), {}),
        "importable, 1 KB numpy array": PythonUDF(noop, (np.ones(256, dtype=np.float32),), {}),
    }


def run(rounds: int, calls: int) -> dict[str, dict[str, float]]:
    import rpcnb
    from rpcnb.paths import serialize
    from rpcnb.wire import _torch

    serialize.install()
    pickler = _torch.rpc_pickler()
    msgs = messages()
    methods: dict[str, Callable[[], Any]] = {
        name: (lambda m=m: pickler.serialize(m)) for name, m in msgs.items()}
    for fn in methods.values():
        for _ in range(50):
            fn()
    per_round: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    perf = time.perf_counter
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = methods[name]
            t0 = perf()
            for _ in range(calls):
                fn()
            per_round[name].append((perf() - t0) / calls)
    del rpcnb
    return {name: {"median_us": statistics.median(v) * 1e6, "min_us": min(v) * 1e6}
            for name, v in per_round.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.pickler")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import rpcnb

    result = run(args.rounds, args.calls)
    width = max(map(len, result))
    print(f"serialize per message (rpcnb from {Path(rpcnb.__file__).parent}):")
    for name, r in result.items():
        print(f"  {name.ljust(width)}  {r['median_us']:7.1f} us  (min {r['min_us']:.1f})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
