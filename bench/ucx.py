"""The UCX path side by side with TensorPipe (uv), rpcnb's shared memory and bare ucxx:
one-way CPU tensors of 10 MB to 512 MB from this process to a worker, in one run.

    .venv/bin/python -m bench.ucx               # -> bench/results/ucx.json, and tables
    .venv/bin/python -m bench.ucx --quick       # 10 and 100 MB, 3 repetitions
    .venv/bin/python -m bench.ucx --section one_host   # or two_namespaces

Two sections. ``one_host``: each path a fresh group (``rpcnb.init(1, ...)``) in this
process. ``two_namespaces``: the worker is a headless ``python -m rpcnb.worker --join``
in a second network namespace joined by a veth pair (the issue's "two hosts"; needs root
and iproute2, else the section says why it was skipped), TensorPipe uv against UCX (over
TCP there), both in one group with ``--ucx``, taking turns call by call (a TensorPipe
call sends the same tensor inside ``rpcnb.paths.shm.suppressed()``). A send is rpcnb's
``probe_sink`` request (the tensor as its argument), timed until the worker has the
tensor and answered. ``bare ucxx`` is the same transfer between
two processes with ucxx alone (a receive posted into a buffer written once before, the
sender told over a pipe): what UCX itself does on this machine, without rpcnb. Medians
of the repetitions after one warm-up; ratios are UCX's time over the other path's (below
1: UCX is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MB = 1 << 20
ONE_HOST = {  # name -> rpcnb.init keywords
    "tensorpipe_uv": {"shm": False},
    "rpcnb_shm": {"shm": True},
    "ucx": {"shm": False, "ucx": True},
}
LABELS = {"tensorpipe_uv": "TensorPipe uv", "rpcnb_shm": "rpcnb shm", "ucx": "UCX",
          "bare_ucxx": "bare ucxx"}
REPO = Path(__file__).resolve().parents[1]


def _time_sends(name: str, sizes: list[int], reps: int,
                turns: dict[str, Any]) -> dict[str, Any]:
    """Times sends to ``name``, size by size, the paths in ``turns`` (label -> a context
    manager factory that makes a send take it) taking turns; a result per label. A send
    labelled ``ucx`` must have gone over UCX, any other must not have."""
    import torch

    from rpcnb.paths import ucx
    from rpcnb.session import protocol, state

    s = state.current()
    out: dict[str, Any] = {label: {} for label in turns}
    for mb in sizes:
        t = torch.ones(mb * MB // 4)
        samples: dict[str, list[float]] = {label: [] for label in turns}
        for i in range(reps + 1):
            for label, how in turns.items():
                before = ucx.stats()["sent"]
                with how():
                    t0 = time.perf_counter()
                    got = protocol.call(s.token, name, "probe_sink", t, timeout=None)
                    dt = time.perf_counter() - t0
                assert got == mb * MB, got
                took_ucx = ucx.stats()["sent"] > before
                assert took_ucx == (label == "ucx"), f"{label}: took UCX {took_ucx}"
                if i:  # the first one opens connections and endpoints
                    samples[label].append(dt)
        for label, xs in samples.items():
            out[label][str(mb)] = {"median_ms": statistics.median(xs) * 1e3,
                                   "samples_ms": [round(x * 1e3, 2) for x in xs]}
    if "ucx" in out:
        out["ucx"]["ucx_transport"] = ucx.transports().get(name, "?")
    return out


def time_path(label: str, kwargs: dict[str, Any], sizes: list[int],
              reps: int) -> dict[str, Any]:
    """``label``'s sends to the worker of a fresh one-worker group made with ``kwargs``."""
    import rpcnb

    rpcnb.init(1, **kwargs)
    try:
        return _time_sends("worker1", sizes, reps, {label: contextlib.nullcontext})[label]
    finally:
        rpcnb.shutdown()


# ---------------------------------------------------------------------- bare ucxx

def _drive(worker: Any, req: Any) -> None:
    """Poll as ``rpcnb.paths.ucx`` does: a short nap after 64 polls that moved nothing, so the
    other side (and the kernel's TCP) get the cores when there are only two."""
    idle = 0
    while not req.completed:
        idle = 0 if worker.progress_once() else idle + 1
        if idle > 64:
            time.sleep(0.0005)
    req.check_error()


def _context(api: Any, device: str) -> Any:
    return api.UCXContext(config_dict={"NET_DEVICES": device},
                          feature_flags=(api.Feature.TAG,))


def bare_peer(device: str) -> None:
    """``--bare-peer DEVICE``: the receiving side of ``time_bare`` (stdin/stdout lines)."""
    os.environ.setdefault("UCX_RNDV_FRAG_MEM_TYPE", "host")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import torch
    import ucxx._lib.libucxx as api
    from ucxx._lib.arr import Array

    worker = api.UCXWorker(_context(api, device))
    print(bytes(worker.address).hex(), flush=True)
    peer, err_mode = sys.stdin.readline().split()
    worker.create_endpoint_from_worker_address(
        api.UCXAddress.create_from_buffer(bytes.fromhex(peer)), err_mode == "1")
    buffers: dict[int, Any] = {}
    for line in sys.stdin:
        tag, nbytes = (int(x) for x in line.split())
        if nbytes not in buffers:
            buffers[nbytes] = torch.zeros(nbytes, dtype=torch.uint8)  # written once
        req = worker.tag_recv(Array(buffers[nbytes].numpy()), api.UCXXTag(tag))
        print("ready", flush=True)
        _drive(worker, req)
        print("done", flush=True)


def time_bare(sizes: list[int], reps: int, prefix: list[str], here: str, there: str,
              err_mode: bool) -> dict[str, Any]:
    """Send from this process to a ``bare_peer`` started with ``prefix`` (``ip netns exec
    NS`` or nothing); UCX's TCP on ``here``/``there``, its peer error handling as rpcnb's."""
    import torch
    import ucxx._lib.libucxx as api
    from ucxx._lib.arr import Array

    os.environ.setdefault("UCX_RNDV_FRAG_MEM_TYPE", "host")
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "bench.ucx", "--bare-peer", there],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.stdin is not None and proc.stdout is not None
    try:
        worker = api.UCXWorker(_context(api, here))
        peer = proc.stdout.readline().strip()
        proc.stdin.write(f"{bytes(worker.address).hex()} {int(err_mode)}\n")
        proc.stdin.flush()
        ep = worker.create_endpoint_from_worker_address(
            api.UCXAddress.create_from_buffer(bytes.fromhex(peer)), err_mode)
        out: dict[str, Any] = {}
        tag = 1
        for mb in sizes:
            t = torch.ones(mb * MB, dtype=torch.uint8)
            samples = []
            for i in range(reps + 1):
                t0 = time.perf_counter()
                proc.stdin.write(f"{tag} {mb * MB}\n")
                proc.stdin.flush()
                assert proc.stdout.readline().strip() == "ready"
                _drive(worker, ep.tag_send(Array(t.numpy()), api.UCXXTag(tag)))
                assert proc.stdout.readline().strip() == "done"
                tag += 1
                if i:
                    samples.append(time.perf_counter() - t0)
            out[str(mb)] = {"median_ms": statistics.median(samples) * 1e3,
                            "samples_ms": [round(x * 1e3, 2) for x in samples]}
        return out
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# ------------------------------------------------------------- two namespaces

def netns_blocker() -> str | None:
    """Why this machine cannot make the second namespace, or None."""
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (this is uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    return None


@contextlib.contextmanager
def veth_pair() -> Iterator[dict[str, str]]:
    """A network namespace joined to this one by a veth pair (bench.netsetup, as the
    tests' ``netns`` fixture); removed at the end."""
    from bench.netsetup import veth_pair as pair

    tag = os.getpid() % 100000
    with pair(f"rpcnb-b{tag}", f"rpb{tag}", f"10.214.{tag % 250}") as net:
        yield net


def time_across(net: dict[str, str], sizes: list[int], reps: int) -> dict[str, Any]:
    """This process leads a group with UCX on the veth address; a headless worker in the
    other namespace joins it with ``--ucx``. Sends over UCX take turns with TensorPipe's
    (the same tensor inside ``shm.suppressed()``, which turns rpcnb's paths off for the
    call): {"tensorpipe_uv": ..., "ucx": ...}."""
    import rpcnb
    from rpcnb.paths import shm, ucx
    from rpcnb.session import state

    rpcnb.init(0, port=0, host=net["addr"], allow_remote=True, ucx=True)
    proc = None
    try:
        s = state.current()
        with tempfile.TemporaryDirectory() as tmp:
            token = Path(tmp) / "connection.json"
            assert s.connection_path is not None
            shutil.copy(s.connection_path, token)
            os.chmod(token, 0o600)
            env = {k: v for k, v in os.environ.items() if k != "RPCNB_UCX"}
            proc = subprocess.Popen(
                ["ip", "netns", "exec", net["ns"], sys.executable, "-m", "rpcnb.worker",
                 "--join", s.init_method, "--token-file", str(token), "--name", "worker1",
                 "--ucx"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=dict(env, PYTHONPATH=str(REPO)))
            deadline = time.monotonic() + 120
            while "worker1" not in dict(s.admitted()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the worker in the other namespace did not join")
                time.sleep(0.2)
        # the UCX path at every size (rpcnb sends below RPCNB_UCX_TCP_THRESHOLD over
        # TensorPipe once it knows the peer is over TCP: these figures are why)
        link = ucx.link()
        assert link is not None, "the group has no UCX path"
        link.tcp_threshold = 0  # this group's: the next one reads RPCNB_UCX_TCP_THRESHOLD
        return _time_sends("worker1", sizes, reps,
                           {"tensorpipe_uv": shm.suppressed, "ucx": contextlib.nullcontext})
    finally:
        rpcnb.shutdown()
        if proc is not None:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


# ---------------------------------------------------------------------- report

def table(section: dict[str, Any], sizes: list[int], others: list[str]) -> str:
    """Medians per path, UCX's time over each other path's, and UCX's throughput."""
    paths = [*others, "ucx"]
    head = ["MB", *(LABELS[p] for p in paths), *(f"UCX/{LABELS[p]}" for p in others),
            "UCX GB/s"]
    rows = [head]
    for mb in sizes:
        k = str(mb)
        ms = {p: section[p][k]["median_ms"] for p in paths}
        rows.append([k, *(f"{ms[p]:.1f} ms" for p in paths),
                     *(f"{ms['ucx'] / ms[p]:.2f}" for p in others),
                     f"{mb * MB / (ms['ucx'] / 1e3) / 1e9:.2f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def one_host(sizes: list[int], reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {"load_before": load()}
    for name, kwargs in ONE_HOST.items():
        print(f"bench.ucx: one host, {name} ...", file=sys.stderr, flush=True)
        out[name] = time_path(name, kwargs, sizes, reps)
    print("bench.ucx: one host, bare ucxx ...", file=sys.stderr, flush=True)
    out["bare_ucxx"] = time_bare(sizes, reps, [], "lo", "lo", False)
    out["load_after"] = load()
    out["table"] = table(out, sizes, ["tensorpipe_uv", "rpcnb_shm", "bare_ucxx"])
    return out


def two_namespaces(sizes: list[int], reps: int) -> dict[str, Any]:
    why = netns_blocker()
    if why:
        return {"skipped": why}
    out: dict[str, Any] = {"load_before": load()}
    with veth_pair() as net:
        print("bench.ucx: two namespaces, TensorPipe uv and UCX in turns ...",
              file=sys.stderr, flush=True)
        out.update(time_across(net, sizes, reps))
        print("bench.ucx: two namespaces, bare ucxx ...", file=sys.stderr, flush=True)
        out["bare_ucxx"] = time_bare(sizes, reps, ["ip", "netns", "exec", net["ns"]],
                                     net["here"], net["there"], True)
    out["load_after"] = load()
    out["table"] = table(out, sizes, ["tensorpipe_uv", "bare_ucxx"])
    big = [str(mb) for mb in sizes if mb >= 100]
    out["target_ucx_at_least_as_fast_as_uv_from_100_mb"] = all(
        out["ucx"][k]["median_ms"] <= out["tensorpipe_uv"][k]["median_ms"] for k in big)
    return out


def run(quick: bool = False, section: str = "all",
        out_path: str | None = None) -> dict[str, Any] | None:
    """Both sections (or one); writes bench/results/ucx.json. None without the extra."""
    import importlib.util

    if importlib.util.find_spec("ucxx") is None:  # not imported: rpcnb sets UCX up first
        print("bench.ucx: skipped, the ucx extra is not installed: pip install 'rpcnb[ucx]'",
              file=sys.stderr)
        return None
    sizes = [10, 100] if quick else [1, 4, 10, 16, 32, 50, 100, 256, 512]
    reps = 3 if quick else 7
    results: dict[str, Any] = {"sizes_mb": sizes, "repetitions": reps,
                               "cpus": os.cpu_count()}
    if section in ("all", "one_host"):
        results["one_host"] = one_host(sizes, reps)
    if section == "two_namespaces":
        results["two_namespaces"] = two_namespaces(sizes, reps)
    elif section == "all":
        # a process of its own: TensorPipe listens on one interface per process
        with tempfile.TemporaryDirectory() as tmp:
            part = Path(tmp) / "two_namespaces.json"
            subprocess.run([sys.executable, "-m", "bench.ucx", "--section", "two_namespaces",
                            "--out", str(part), *(["--quick"] if quick else [])],
                           cwd=REPO, check=False, stdout=subprocess.DEVNULL)
            results["two_namespaces"] = (json.loads(part.read_text())["two_namespaces"]
                                         if part.exists() else {"skipped": "the run failed"})
    path = Path(out_path or Path(__file__).parent / "results" / "ucx.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    for name in ("one_host", "two_namespaces"):
        if name in results:
            part = results[name]
            print(f"\nUCX, {name.replace('_', ' ')} (load {part.get('load_before', '-')}):")
            print(part.get("table") or f"skipped: {part.get('skipped')}")
            if "ucx" in part:
                print(f"UCX transport: {part['ucx'].get('ucx_transport')}")
    return results


def section(quick: bool = False) -> int:
    """``make bench``'s UCX section (bench/run.py calls it last): this module in a process
    of its own; a quick run writes bench/results/ucx-quick.json, not ucx.json."""
    out = ["--quick", "--out", str(Path(__file__).parent / "results" / "ucx-quick.json")]
    return subprocess.run([sys.executable, "-m", "bench.ucx", *(out if quick else [])],
                          cwd=REPO, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--section", choices=["all", "one_host", "two_namespaces"], default="all")
    ap.add_argument("--out", default=None)
    ap.add_argument("--bare-peer", default=None, metavar="DEVICE", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.bare_peer:
        bare_peer(args.bare_peer)
        return 0
    return 0 if run(args.quick, args.section, args.out) is not None else 2


if __name__ == "__main__":
    sys.exit(main())
