"""The timed loops, run inside a real IPython kernel (the notebook's process).

``bench.run`` starts kernels and calls these functions from cells; each returns plain
data (seconds) that the cell prints as one JSON line. Timing happens here, in the kernel,
so the figures are what code in a notebook cell sees, without the front end's messaging.
Magics are timed through ``get_ipython().run_cell_magic``, the call a cell makes.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any

MARK = "@@bench@@"


def emit(result: Any) -> None:
    """Print ``result`` as the JSON line ``bench.run`` looks for in the cell's stdout."""
    print(MARK + json.dumps(result))


def _ip() -> Any:
    from IPython import get_ipython

    ip = get_ipython()
    if ip is None:
        raise RuntimeError("bench.in_kernel runs inside an IPython kernel")
    return ip


def compare(methods: dict[str, Callable[[], Any]], calls: int, rounds: int,
            warmup: int) -> dict[str, list[float]]:
    """Per-call seconds of each method: ``rounds`` rounds of ``calls`` calls each.

    The methods take turns round by round (the starting one rotates), so a burst of load
    from elsewhere on the machine hits every method alike instead of one of them.
    """
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    names = list(methods)
    samples: dict[str, list[float]] = {k: [] for k in names}
    perf = time.perf_counter
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = methods[name]
            out = samples[name]
            for _ in range(calls):
                t0 = perf()
                fn()
                out.append(perf() - t0)
    return samples


# --------------------------------------------------------------------------- round trip


def roundtrip(rc: Any, calls: int, rounds: int, warmup: int,
              rpcnb_up: bool = True) -> dict[str, list[float]]:
    """No-op round trip to one worker or engine, five ways, plus %%px on two engines.

    Needs an rpcnb group with ``worker1`` (unless ``rpcnb_up`` is false) and/or the
    ipyparallel client ``rc`` of a running cluster (unless it is None), in this kernel.
    """
    ip = _ip()
    methods: dict[str, Callable[[], Any]] = {}
    if rpcnb_up:
        import torch.distributed.rpc as rpc

        import rpcnb
        from bench.targets import noop, uses_torch

        # the same function defined in a notebook cell: rpcnb ships it by value
        exec("import torch\ndef nb_uses_torch():\n    return torch.float32\n", ip.user_ns)
        notebook_fn = ip.user_ns["nb_uses_torch"]
        methods["rpc_sync"] = lambda: rpc.rpc_sync("worker1", noop)
        methods["rpc_sync fn using torch (importable)"] = lambda: rpc.rpc_sync("worker1", uses_torch)
        methods["rpc_sync fn using torch (notebook)"] = lambda: rpc.rpc_sync("worker1", notebook_fn)
        methods["rpcnb.run"] = lambda: rpcnb.run("worker1", "None")
        methods["%%remote"] = lambda: ip.run_cell_magic("remote", "worker1", "None")
    if rc is not None:
        from bench.targets import noop

        engine0 = rc[0]
        engine0.block = True
        rc.activate(targets=0)  # %px / %%px on engine 0: one engine, as %%remote worker1
        rc.activate(targets="all", suffix="_all")  # %%px_all on both engines
        methods["ipp apply_sync"] = lambda: engine0.apply_sync(noop)
        methods["%%px"] = lambda: ip.run_cell_magic("px", "", "pass")
        methods["%%px (2 engines)"] = lambda: ip.run_cell_magic("px_all", "", "pass")
    return compare(methods, calls, rounds, warmup)


def torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


# --------------------------------------------------------------------------- fan-out


def fanout(counts: list[int], calls: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    """A no-op cell on the first n workers at once, for each n in ``counts``.

    ``raw n`` is torch's own ``rpc_async`` of a no-op to each at once (the floor);
    ``api n`` is ``rpcnb.run([...], "None")``, the engine behind the magic; ``magic n``
    is ``%%remote worker1,...,workern`` (for n = 1 the single-worker form ``worker1``).
    """
    import torch.distributed.rpc as rpc

    import rpcnb
    from bench.targets import noop

    def raw(names: list[str]) -> None:
        for fut in [rpc.rpc_async(name, noop) for name in names]:
            fut.wait()

    ip = _ip()
    methods: dict[str, Callable[[], Any]] = {}
    for n in counts:
        names = [f"worker{i}" for i in range(1, n + 1)]
        # the floor: torch RPC itself, a no-op to the same workers at once
        methods[f"raw {n}"] = functools.partial(raw, names)
        methods[f"api {n}"] = functools.partial(rpcnb.run, names, "None")
        methods[f"magic {n}"] = functools.partial(ip.run_cell_magic, "remote", ",".join(names), "None")
    return compare(methods, calls, rounds, warmup)


# --------------------------------------------------------------------------- transfer


def _shm() -> Any:
    try:
        from rpcnb.paths import shm
    except ImportError:
        return None
    if not (hasattr(shm, "set_enabled") and hasattr(shm, "is_enabled")):
        return None
    return shm


def _arrays() -> Any:
    """rpcnb's array path where this tree has it (an older tree: None)."""
    try:
        from rpcnb.paths import arrays
    except ImportError:
        return None
    return arrays if hasattr(arrays, "set_enabled") else None


def _sent(shm: Any) -> int | None:
    if shm is None or not hasattr(shm, "stats"):
        return None
    return int(shm.stats().get("sent", 0))


def transfer(sizes_mb: list[int], reps: dict[str, int], warmup: int) -> dict[str, Any]:
    """One-way CPU tensor to worker1: TensorPipe, rpcnb's shared-memory path, memcpy, and
    a NumPy array of the same size.

    The time is the round trip of ``rpc_sync("worker1", consume, args=(t,))``, which
    answers with ``t.numel()``. "tensorpipe" runs with rpcnb's shared-memory path off,
    "rpcnb" with it on, "numpy" sends a NumPy array instead of the tensor (shared-memory
    path on; ``consume_array`` answers with its size, or -1 if it did not arrive as a
    NumPy array), "numpy pickled" the same array with rpcnb's array path off (pickled into
    the message, as torch RPC does it without rpcnb); "memcpy" is ``dst.copy_(t)`` into a
    preallocated tensor here, back to back (the copy at its best), and "memcpy between calls" is the same copy
    taking turns with the sends (as the shared-memory path's own copy does: torch's
    copy threads have gone to sleep and must be woken, which on a busy small machine
    can take longer than the copy). Whether the shared-memory path really carried a send
    is read from its own counters.
    """
    shm = _shm()
    was_on = shm.is_enabled() if shm is not None else None
    out: dict[str, Any] = {
        "shm": "missing" if shm is None else "present",
        "shm_active": bool(shm.is_active()) if shm is not None and hasattr(shm, "is_active") else None,
        "sizes": {},
    }
    try:
        for mb in sizes_mb:
            n = reps.get(str(mb), reps.get("default", 5))
            out["sizes"][str(mb)] = _transfer_size(mb << 20, n, warmup, shm)
        if shm is not None and hasattr(shm, "stats"):
            out["shm_stats"] = shm.stats()
    finally:
        if shm is not None and was_on is not None:
            shm.set_enabled(was_on)
    return out


def _transfer_size(nbytes: int, n: int, warmup: int, shm: Any) -> dict[str, Any]:
    import numpy
    import torch
    import torch.distributed.rpc as rpc

    from bench.targets import consume, consume_array

    t = torch.ones(nbytes // 4, dtype=torch.float32)  # pages touched
    array = numpy.ones(nbytes // 4, dtype=numpy.float32)  # memory of its own
    dst = torch.empty_like(t)
    dst.copy_(t)  # fault dst's pages in, as a reused buffer would be
    modes = ["tensorpipe", "memcpy between calls"] + (["rpcnb", "numpy"] if shm is not None else [])
    arrays = _arrays()
    if arrays is not None:
        modes.append("numpy pickled")
    samples: dict[str, list[float]] = {m: [] for m in modes}
    taken: dict[str, int] = {m: 0 for m in modes}
    perf = time.perf_counter

    def once(mode: str, record: bool) -> None:
        if mode == "memcpy between calls":
            t0 = perf()
            dst.copy_(t)
            dt = perf() - t0
        else:
            if shm is not None:
                shm.set_enabled(mode in ("rpcnb", "numpy"))
            if arrays is not None:
                arrays.set_enabled(mode != "numpy pickled")
            before = _sent(shm)
            t0 = perf()
            if mode.startswith("numpy"):
                got = rpc.rpc_sync("worker1", consume_array, args=(array,))
            else:
                got = rpc.rpc_sync("worker1", consume, args=(t,))
            dt = perf() - t0
            assert got == t.numel(), got
            after = _sent(shm)
            if record and before is not None and after is not None:
                taken[mode] += after - before
        if record:
            samples[mode].append(dt)

    for mode in modes:
        for _ in range(warmup):
            once(mode, record=False)
    for r in range(n):
        k = r % len(modes)
        for mode in modes[k:] + modes[:k]:
            once(mode, record=True)
    if arrays is not None:
        arrays.set_enabled(True)
    hot = []
    for _ in range(n):
        t0 = perf()
        dst.copy_(t)
        hot.append(perf() - t0)
    samples["memcpy"] = hot
    return {"bytes": nbytes, "samples": samples,
            "shm_sends": taken if shm is not None and hasattr(shm, "stats") else None}


# --------------------------------------------------------------------------- start-up


_state: dict[str, Any] = {}


def start_rpcnb(workers: int = 2, extra: str = "") -> dict[str, float]:
    """From ``%load_ext rpcnb`` to the first ``%%remote worker1 --fetch`` value.

    ``extra`` is appended to the ``%rpc_init`` line (``bench.run --rpc-args``).
    """
    ip = _ip()
    perf = time.perf_counter
    t0 = perf()
    ip.run_line_magic("load_ext", "rpcnb")
    t1 = perf()
    ip.run_line_magic("rpc_init", f"--workers {workers} {extra}".strip())
    t2 = perf()
    value = ip.run_cell_magic("remote", "worker1 --fetch", "1")
    t3 = perf()
    assert value == 1, value
    return {"load_s": t1 - t0, "init_s": t2 - t1, "first_result_s": t3 - t2, "total_s": t3 - t0}


def stop_rpcnb() -> None:
    ip = _ip()
    from rpcnb import api

    if api.is_initialized():
        ip.run_line_magic("rpc_shutdown", "")


def start_ipp(engines: int = 2) -> dict[str, float]:
    """From ``import ipyparallel`` to the first ``apply_sync`` value of a fresh cluster."""
    perf = time.perf_counter
    t0 = perf()
    import ipyparallel as ipp

    from bench.targets import one

    t1 = perf()
    cluster = ipp.Cluster(n=engines)
    _state["cluster"] = cluster
    rc = cluster.start_and_connect_sync()
    _state["rc"] = rc
    t2 = perf()
    value = rc[0].apply_sync(one)
    t3 = perf()
    assert value == 1, value
    return {"load_s": t1 - t0, "init_s": t2 - t1, "first_result_s": t3 - t2, "total_s": t3 - t0}


def stop_ipp() -> None:
    rc = _state.pop("rc", None)
    cluster = _state.pop("cluster", None)
    try:
        if rc is not None:
            rc.close()
    finally:
        if cluster is not None:
            cluster.stop_cluster_sync()
