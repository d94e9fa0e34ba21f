"""``python -m rpcnb.keeper``: the first member of a kept group (``%rpc_init --keep``), a
process of its own that outlives the kernel which asked for it
(``rpcnb.membership.kept``).

It starts the group as its leader (``rpcnb.init``: the rendezvous, the workers, the death
watcher) under the name ``keeper`` and runs no cells of its own. Every second it writes
its record: the workers and their pids, the dead ones, the kernel attached (a member of
kind ``kernel``), since when none is; every 10 s, what the workers say of their memory
(GPU memory included: only a process itself knows what its CUDA allocator holds). When
none has been attached for its idle limit, or on SIGTERM (``%rpc_shutdown``), it ends the
group (every worker leaves or is stopped, its shared memory and folders go) and removes
its record.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

POLL_S = 1.0  # seconds between two looks at who is attached
MEMORY_EVERY = 10.0  # seconds between asking the workers for their memory (%rpc_groups)
ASK_S = 3.0  # how long a worker gets to say it


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rpcnb.keeper",
                                 description="The keeper of a kept rpcnb group.")
    ap.add_argument("--group", required=True)
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--keep", type=float, required=True, help="seconds without a kernel")
    ap.add_argument("--options", default="{}", help="JSON of rpcnb.init's keyword arguments")
    args = ap.parse_args(argv)

    from rpcnb.membership import kept
    from rpcnb.procs.processes import started_at

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a kernel's interrupt is not for it
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    rec = kept.read(args.group) or kept.Record(args.group, args.keep)
    rec.pid, rec.started = os.getpid(), started_at(os.getpid()) or 0.0
    kept.write(rec)
    from rpcnb import api
    from rpcnb.session import state

    try:
        api.init(args.workers, name=kept.KEEPER, **json.loads(args.options))
    except Exception as exc:
        rec.failed = f"{type(exc).__name__}: {exc}"
        kept.write(rec)
        print(f"rpcnb.keeper: {rec.failed}", file=sys.stderr, flush=True)
        return 2
    s = state.current()
    s.kept_group = args.group
    if s.runner is not None:
        s.runner.kind_name = "keeper"
    me = s.members.get(kept.KEEPER)
    if me is not None:
        me.kind = "keeper"
    rec.connection = str(s.connection_path)
    rec.group_id, rec.folder = str(s.group_id), str(s.group_dir or "")
    rec.idle_since = time.time()
    print(f"rpcnb.keeper: group {args.group} up: {rec.connection}", flush=True)
    asked = 0.0
    try:
        while not stop.is_set():
            _note(s, rec)
            if time.monotonic() - asked > MEMORY_EVERY:
                _memory(s, rec)
                asked = time.monotonic()
            kept.write(rec)
            if rec.idle_since is not None and time.time() - rec.idle_since > args.keep:
                print(f"rpcnb.keeper: no kernel attached for {args.keep:g} s: ending "
                      f"{args.group}", flush=True)
                break
            stop.wait(POLL_S)
    finally:
        try:
            api.shutdown(timeout=10)
        finally:
            kept.remove(args.group)
    return 0


def _note(s: Any, rec: Any) -> None:
    """Who is in the group now: workers (and their pids), the dead, the kernel attached."""
    members, dead = s.records(), s.dead()
    workers = sorted((m for m in members if m.kind not in ("kernel", "keeper")),
                     key=lambda m: m.rank)
    rec.workers = {m.name: int(m.pid or 0) for m in workers if m.name not in dead}
    rec.dead = {m.name: dead[m.name] or "died" for m in workers if m.name in dead}
    kernels = [m for m in members if m.kind == "kernel" and m.name not in dead and m.alive]
    if kernels:
        rec.attached, rec.attached_pid = kernels[-1].name, int(kernels[-1].pid or 0)
        rec.idle_since = None
    else:
        if rec.attached or rec.idle_since is None:
            rec.idle_since = time.time()
        rec.attached, rec.attached_pid = "", 0


def _memory(s: Any, rec: Any) -> None:
    """What each live worker says of its memory (``describe_self``'s: rss, shm and each
    CUDA device's, as %rpc_workers shows it), and the keeper's own rss. A worker that
    does not answer in time keeps what it said last."""
    from rpcnb.membership.kept import KEEPER
    from rpcnb.procs.processes import rss_bytes
    from rpcnb.session import protocol

    futs = {}
    for name in rec.workers:
        try:
            futs[name] = protocol.call_async(s.token, name, "describe_self", timeout=ASK_S)
        except Exception:
            pass
    memory = {n: m for n, m in rec.memory.items() if n in rec.workers}
    for name, fut in futs.items():
        try:
            memory[name] = dict(fut.wait().get("memory") or {})
        except Exception:
            continue
    memory[KEEPER] = {"rss": rss_bytes()}
    rec.memory = memory


if __name__ == "__main__":
    sys.exit(main())
