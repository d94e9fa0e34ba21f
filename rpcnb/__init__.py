"""rpcnb: a Jupyter notebook as the driver of a torch.distributed.rpc group.

``%load_ext rpcnb`` registers the magics and the RRef display and imports nothing heavy;
torch is imported when a group starts. The same things are plain functions here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rpcnb.errors import CompositeRemoteError, RemoteError, RpcnbError, WorkerDiedError

if TYPE_CHECKING:
    from rpcnb.session import Group

__version__ = "0.1.0"
__all__ = [
    "ALL",
    "CompositeRemoteError",
    "RemoteError",
    "RpcnbError",
    "WorkerDiedError",
    "group",
    "init",
    "interrupt",
    "join",
    "load_ipython_extension",
    "run",
    "shutdown",
]

ALL = "--all"


def init(workers: int = 0, **kwargs: Any) -> Group:
    """Start a group; see ``rpcnb.session.init``."""
    from rpcnb import session

    return session.init(workers, **kwargs)


def join(address: str, name: str, **kwargs: Any) -> Group:
    """Join a running group; see ``rpcnb.session.join``."""
    from rpcnb import session

    return session.join(address, name, **kwargs)


def run(target: Any, source: str, **kwargs: Any) -> Any:
    """Run a cell on worker(s); see ``rpcnb.session.run``."""
    from rpcnb import session

    return session.run(target, source, **kwargs)


def group() -> Group:
    """The group now (what ``%rpc_workers`` shows)."""
    from rpcnb import session

    return session.group()


def interrupt(worker: str) -> None:
    from rpcnb import session

    session.interrupt(worker)


def shutdown(timeout: float = 10.0) -> None:
    """Leave the group; on the first kernel, every worker leaves first."""
    from rpcnb import session

    session.shutdown(timeout=timeout)


def load_ipython_extension(ip: Any) -> None:
    from rpcnb import display, launch, serialize
    from rpcnb.magics import RpcMagics

    launch.apply_quiet_env()  # before torch is imported, so TensorPipe stays quiet
    serialize.watch()
    ip.register_magics(RpcMagics)
    display.register(ip)


