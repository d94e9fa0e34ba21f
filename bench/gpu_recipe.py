"""The PyTorch CUDA RPC recipe's ``measure`` in a group of torch alone, on a GPU machine:
the baseline that ``bench/gpu.py`` sets beside the same recipe run in an rpcnb group.

    python -m bench.gpu_recipe [--local cuda:0] [--remote cuda:0] [--turns 5] [--transports uv]

(``--local cpu --remote cpu`` runs it without a GPU, without a device map: a rehearsal.)

Two processes (this one, ``worker0``, and a peer it starts, ``worker1``) form the group with
torch's own ``init_rpc``, the recipe's options (128 threads) and its device map, then
``worker0`` runs ``measure("cpu")`` and ``measure("cuda")`` in turns and prints one JSON line:
``{"cpu": [seconds, ...], "cuda": [...]}``. ``MyModule`` lives here, importable (the peer
finds it on ``PYTHONPATH``), as in the recipe's script; ``bench/gpu.py`` gives the rpcnb
group the same class defined in ``__main__``, as a notebook cell defines it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.autograd as autograd
import torch.distributed.rpc as rpc
import torch.nn as nn

from bench import python_path

ROOT = Path(__file__).resolve().parent.parent


class MyModule(nn.Module):
    """The recipe's module: a Linear(1000, 1000) on ``device``; in ``cpu`` mode it sends
    its output back through host memory, in ``cuda`` mode device to device."""

    def __init__(self, device: str, comm_mode: str) -> None:
        super().__init__()
        self.device = device
        self.linear = nn.Linear(1000, 1000).to(device)
        self.comm_mode = comm_mode

    def forward(self, x: Any) -> Any:
        y = self.linear(x.to(self.device))
        return y.cpu() if self.comm_mode == "cpu" else y


def measure(cls: Any, comm_mode: str, local: str, remote: str) -> float:
    """The recipe's ``measure``: ten forward and backward passes through a local and a
    remote ``cls``, under distributed autograd; seconds."""
    lm = cls(local, comm_mode)
    rm = rpc.remote("worker1", cls, args=(remote, comm_mode))
    x = torch.randn(1000, 1000).to(local)
    tik = time.time()
    for _ in range(10):
        with autograd.context() as ctx:
            y = rm.rpc_sync().forward(lm(x))
            autograd.backward(ctx, [y.sum()])
    if torch.device(local).type == "cuda":
        torch.cuda.current_stream(local).synchronize()
    return time.time() - tik


def _options(store: str, local: str, remote: str, rank: int, transports: str) -> Any:
    o = rpc.TensorPipeRpcBackendOptions(
        init_method=f"file://{store}", num_worker_threads=128,
        **({"_transports": transports.split(",")} if transports else {}))
    if rank == 0 and torch.device(local).type == "cuda":
        o.set_device_map("worker1", {torch.device(local).index: torch.device(remote).index})
    return o


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.gpu_recipe")
    ap.add_argument("--local", default="cuda:0")
    ap.add_argument("--remote", default="cuda:0")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--transports", default="",
                    help="TensorPipe's transports, e.g. uv (default: torch's, shm and uv)")
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank == 1:  # the peer: serves worker0's calls until it shuts down
        rpc.init_rpc("worker1", rank=1, world_size=2,
                     rpc_backend_options=_options(args.store, args.local, args.remote, 1,
                                                       args.transports))
        rpc.shutdown()
        return 0
    tmp = tempfile.mkdtemp(prefix="bench-gpu-recipe-")
    store = os.path.join(tmp, "store")
    env = dict(os.environ, PYTHONPATH=python_path())  # it finds bench.gpu_recipe there
    peer = subprocess.Popen([sys.executable, "-m", "bench.gpu_recipe", "--rank", "1",
                             "--store", store, "--local", args.local, "--remote", args.remote,
                             "--transports", args.transports],
                            cwd=ROOT, env=env, start_new_session=True)
    try:
        rpc.init_rpc("worker0", rank=0, world_size=2,
                     rpc_backend_options=_options(store, args.local, args.remote, 0,
                                                       args.transports))
        out: dict[str, list[float]] = {"cpu": [], "cuda": []}
        for _ in range(args.turns):
            for mode in out:
                out[mode].append(measure(MyModule, mode, args.local, args.remote))
        rpc.shutdown()
        peer.wait(60)
        print(json.dumps(out), flush=True)
        return 0
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
