"""The launcher every program in this folder shares when it runs as a script: the usual
torch RPC boilerplate that a notebook replaces with ``%rpc_init --workers N``.

``python PROGRAM.py OUT.json`` spawns ``WORLD_SIZE`` processes with ``mp.spawn``; each
calls ``rpc.init_rpc("worker<rank>", ...)`` (TensorPipe over TCP on loopback, a
``file://`` rendezvous); ``worker0`` runs the program's ``run(world_size)`` and writes
``{"result": ..., "pids": {name: [pid, ppid]}}`` as JSON to OUT.json; then every process
calls ``rpc.shutdown()``. The pids let the tests check that the script really ran in
separate processes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

RPC_TIMEOUT = 60  # seconds; the programs take a few


def _pids() -> list[int]:
    return [os.getpid(), os.getppid()]


def _worker(rank: int, world_size: int, init_file: str, out: str,
            run: Callable[[int], Any]) -> None:
    os.environ["TP_SOCKET_IFNAME"] = "lo"
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{init_file}",
                                              _transports=["uv"], rpc_timeout=RPC_TIMEOUT)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=options)
    if rank == 0:
        result = run(world_size)
        pids = {f"worker{r}": rpc.rpc_sync(f"worker{r}", _pids) for r in range(world_size)}
        with open(out, "w") as f:
            json.dump({"result": result, "pids": pids}, f)
    rpc.shutdown()


def main(run: Callable[[int], Any], world_size: int) -> None:
    """What a program's ``if __name__ == "__main__":`` calls."""
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT.json")
    with tempfile.TemporaryDirectory(prefix="rpcnb-program-") as tmp:
        mp.spawn(_worker, args=(world_size, os.path.join(tmp, "store"), sys.argv[1], run),
                 nprocs=world_size, join=True)
