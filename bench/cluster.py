"""Start-up of a cluster of engines: plain ipyparallel against rpcnb's engines as members.

``python -m bench.cluster [--repeats N] [--engines N]`` times, in fresh Python processes
that take turns (so a burst of load from elsewhere hits each alike), from the first import
to the first result on every engine:

- ipyparallel: ``ipp.Cluster(n=N).start_and_connect_sync()``, then ``apply_sync`` of a
  trivial function on every engine;
- rpcnb engines: ``rpcnb.integrations.ipyparallel.start(N)`` (the same cluster, then each engine joins the
  torch RPC group), then ``rpcnb.run(ALL, "1", fetch=True)``;
- rpcnb workers, for reference: ``rpcnb.init(N)`` and the same cell.

It prints the medians and the ratio to plain ipyparallel. rpcnb's engines cost
ipyparallel's start-up plus the joins (torch imported on each engine, TensorPipe agents);
there is no target for this figure in the issue, it is here to be known.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile

PLAIN = """
import time, sys
t0 = time.perf_counter()
import ipyparallel as ipp
c = ipp.Cluster(n={n}, profile_dir=sys.argv[1], log_level=40)
rc = c.start_and_connect_sync()
rc[:].apply_sync(int)
print("@@", time.perf_counter() - t0)
rc.close()
c.stop_cluster_sync()
"""

ENGINES = """
import time, sys
t0 = time.perf_counter()
import rpcnb, rpcnb.integrations.ipyparallel
rpcnb.integrations.ipyparallel.start({n}, "local", {{"profile_dir": sys.argv[1]}})
rpcnb.run(rpcnb.ALL, "1", fetch=True)
print("@@", time.perf_counter() - t0)
rpcnb.shutdown()
"""

WORKERS = """
import time
t0 = time.perf_counter()
import rpcnb
rpcnb.init({n})
rpcnb.run(rpcnb.ALL, "1", fetch=True)
print("@@", time.perf_counter() - t0)
rpcnb.shutdown()
"""


def once(code: str) -> float:
    with tempfile.TemporaryDirectory(prefix="rpcnb-bench-") as profile:
        out = subprocess.run([sys.executable, "-c", code, profile], capture_output=True,
                             text=True, timeout=300)
    for line in out.stdout.splitlines():
        if line.startswith("@@ "):
            return float(line[3:])
    raise RuntimeError(f"no timing from the run (exit {out.returncode}):\n{out.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", type=int, default=2)
    args = ap.parse_args(argv)
    methods = {"ipyparallel Cluster(n)": PLAIN, "rpcnb --engines n": ENGINES,
               "rpcnb --workers n": WORKERS}
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for i in range(args.repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:  # take turns
            times[name].append(once(methods[name].format(n=args.engines)))
    base = statistics.median(times[names[0]])
    print(f"start to first result on every one of {args.engines} engines/workers, "
          f"medians of {args.repeats} fresh processes")
    for name in names:
        med = statistics.median(times[name])
        runs = " ".join(f"{t:.2f}" for t in times[name])
        print(f"{name:<26} {med:6.2f} s   {med / base:5.2f}x ipyparallel   ({runs})")


if __name__ == "__main__":
    main()
