"""Collectives next to RPC (``%rpc_init --workers N --collectives gloo|nccl|auto``): the
workers the first kernel started also form a ``torch.distributed`` process group, ranks
in worker order (worker1 is rank 0), world size the number of workers, so
``dist.all_reduce``, ``all_gather``, ``barrier`` and DDP work in ``%%remote --all`` cells,
beside RPC and RRefs in the same processes. The kernel is no rank: it drives.

The group's store is a ``FileStore`` in the group's private folder (a TCP store's prefix
where the group meets over TCP); gloo and NCCL listen on the interface TensorPipe uses
(loopback on one host). Every collective has the time limit given at start: a collective
that not every rank joins fails within it. The cell's error then names the ranks that never
came (``cells.call``) and the process group is formed again (``reform``), since a timed-out
collective leaves the ranks out of step. ``%rpc_shutdown`` ends the process group with the
workers. Restarting or adding a worker is refused: the world size is fixed when it forms.
"""

from __future__ import annotations

import datetime
from typing import Any

from rpcnb import settings
from rpcnb.errors import RpcnbError
from rpcnb.session import protocol, rendezvous
from rpcnb.session.members import Collectives
from rpcnb.session.state import Session

BACKENDS = ("gloo", "nccl", "auto")
DEFAULT_TIMEOUT = 60.0  # seconds a collective waits for every rank
FIXED = (
    "This group's workers form a process group (--collectives {backend}) of a fixed size "
    "({n}), so {what} would leave it out: %rpc_shutdown, then %rpc_init with the workers "
    "you want."
)
NO_NCCL = (
    "--collectives nccl needs a CUDA device on every worker, and {names} have none: use "
    "--collectives gloo (or auto), or give the workers GPUs with --gpus."
)
SHARED_GPU = (
    "--collectives nccl needs a GPU of its own for every rank, and {pairs}: NCCL refuses "
    "two ranks on one GPU. Use --collectives gloo (auto picks it here), or give each "
    "worker its own GPU (--gpus auto, on a machine with a GPU per worker)."
)
AUTO_GLOO = ", since {pairs}: NCCL takes one GPU per rank"
REFORMED = ("rpcnb: the workers' process group was formed again ({backend}, {n} ranks): a "
            "collective that timed out leaves the ranks out of step.")
FORMED = ("rpcnb: the workers form a process group ({backend}{why}): {first}..{last} are ranks "
          "0..{top}; a collective waits {timeout:g} s for every rank.")


def check(backend: str | None, timeout: float | None) -> None:
    """Refuse a backend or time limit that cannot work, before anything starts."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"--collectives takes {', '.join(BACKENDS)}, not {backend!r}.")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"--collective-timeout must be a positive number of seconds, "
                         f"not {timeout!r}.")


def choose(backend: str, devices: dict[str, list[str]]) -> str:
    """``auto``: nccl where every worker has a CUDA device, else gloo."""
    without = [n for n, devs in devices.items() if not any(d.startswith("cuda") for d in devs)]
    if backend == "auto":
        return "gloo" if without else "nccl"
    if backend == "nccl" and without:
        raise RpcnbError(NO_NCCL.format(names=", ".join(without)))
    return backend


def shared_gpus(gpus: dict[str, str | None]) -> str:
    """The ranks that would share a GPU under NCCL, in words ("" when none do);
    ``gpus``: worker -> the UUID of the GPU it would use (``gpu_for``)."""
    by_gpu: dict[str, list[str]] = {}
    for w, uuid in gpus.items():
        if uuid is not None:
            by_gpu.setdefault(uuid, []).append(w)
    return "; ".join(f"{' and '.join(ws)} share one GPU" for ws in by_gpu.values()
                     if len(ws) > 1)


def form(s: Session, backend: str, workers: list[str], timeout: float = DEFAULT_TIMEOUT) -> str:
    """Make ``workers`` (in this order: ranks 0..n-1) a process group; on the leader."""
    devices = {w: list(m.devices) if (m := s.members.get(w)) is not None else []
               for w in workers}
    chosen = choose(backend, devices)
    why = ""
    if chosen == "nccl":  # one GPU per rank, or NCCL fails at the first collective
        asks = [protocol.call_async(s.token, w, "collectives_gpu", rank, timeout=60)
                for rank, w in enumerate(workers)]
        pairs = shared_gpus({w: fut.wait() for w, fut in zip(workers, asks, strict=True)})
        if pairs and backend == "nccl":
            raise RpcnbError(SHARED_GPU.format(pairs=pairs))
        if pairs:
            chosen, why = "gloo", AUTO_GLOO.format(pairs=pairs)
    formed = s.collectives.formed + 1 if s.collectives is not None else 1
    where = _store_spec(s, formed)
    futures = [protocol.call_async(s.token, w, "collectives", chosen, rank, len(workers),
                                   where, float(timeout), timeout=timeout + 30)
               for rank, w in enumerate(workers)]
    for fut in futures:  # init_process_group returns on every rank once all have come
        fut.wait()
    s.collectives = Collectives(chosen, {w: r for r, w in enumerate(workers)}, float(timeout),
                                formed, lambda: reform(s))
    return FORMED.format(backend=chosen, why=why, first=workers[0], last=workers[-1],
                         top=len(workers) - 1, timeout=timeout)


def reform(s: Session) -> str:
    """Form the process group again (after a collective timed out); the sentence to show."""
    info = s.collectives
    if info is None:
        return ""
    workers = sorted(info.ranks, key=info.ranks.__getitem__)
    live = [w for w in workers if not s.is_dead(w)]
    if len(live) != len(workers):
        return ""
    futures = [protocol.call_async(s.token, w, "collectives_end", timeout=30) for w in workers]
    for fut in futures:
        try:
            fut.wait()
        except Exception:
            pass
    form(s, info.backend, workers, info.timeout)
    return REFORMED.format(backend=info.backend, n=len(workers))


def refuse_resize(s: Session, what: str) -> None:
    """Restarting or adding a worker is refused in a group with collectives."""
    info = s.collectives
    if info is not None:
        raise RpcnbError(FIXED.format(backend=info.backend, n=len(info.ranks), what=what))


def _store_spec(s: Session, gen: int) -> dict[str, Any]:
    """Where the ranks meet the ``gen``-th time they form: a new file in the group's
    folder, or a prefix of the TCP store (a new one for each forming: a store's keys cannot
    be taken back)."""
    if s.group_dir is not None and str(s.init_method).startswith("file://"):
        return {"file": str(s.group_dir / f"collectives-{gen}")}
    host, port = str(s.init_method)[len("tcp://"):].rsplit(":", 1)
    return {"tcp": [host, int(port)], "prefix": rendezvous.collectives_prefix(gen)}


# -- on a worker -------------------------------------------------------------------------


def gpu_index(rank: int) -> int:
    """The CUDA device this worker's rank uses under NCCL: its own GPU when rpcnb gave it
    one (--gpus), else the rank's turn among the GPUs it sees (one GPU per rank)."""
    import torch

    return rank % max(1, torch.cuda.device_count())


def gpu_for(rank: int) -> str | None:
    """The UUID of the GPU ``rank`` would use under NCCL (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(gpu_index(rank)).uuid)


def join(s: Session, backend: str, rank: int, world: int, where: dict[str, Any],
         timeout: float) -> int:
    """This worker becomes ``rank`` of the workers' process group (blocks until all have)."""
    import torch.distributed as dist

    iface = settings.other("TP_SOCKET_IFNAME") or "lo"  # where TensorPipe listens too
    settings.set_default("GLOO_SOCKET_IFNAME", iface)
    settings.set_default("NCCL_SOCKET_IFNAME", iface)
    limit = datetime.timedelta(seconds=timeout)
    if "file" in where:
        store: Any = dist.FileStore(where["file"], world)
    else:
        host, port = where["tcp"]
        store = dist.PrefixStore(where["prefix"], dist.TCPStore(
            host, int(port), is_master=False, timeout=limit))
    if dist.is_initialized():
        dist.destroy_process_group()
    if backend == "nccl":  # before the group forms: NCCL binds each rank to its device
        import torch

        torch.cuda.set_device(gpu_index(rank))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=limit)
    return rank


def end() -> None:
    """This worker leaves the process group (before it is formed again)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
