"""rpcnb: a Jupyter notebook as the driver of a torch.distributed.rpc group.

``%load_ext rpcnb`` registers the magics and the RRef display and imports nothing heavy;
torch is imported when a group starts. Every magic has a plain function here:
``init`` (``%rpc_init``), ``join`` (``%rpc_init --join``), ``run`` (``%%remote``),
``run_bg`` (``%%remote --bg``), ``jobs`` (``%rpc_jobs``), ``group`` (``%rpc_workers``),
``restart`` (``%rpc_restart``), ``add_workers`` (``%rpc_init --add``), ``interrupt`` and
``shutdown`` (``%rpc_shutdown``).
They are ``rpcnb.api``'s, loaded on first use. ``attach`` (``%rpc_init --attach``) makes
this process the driver of a kept group again (``init(..., keep=...)``), or makes the
engines of a running ipyparallel cluster members (``rpcnb.integrations.ipyparallel``).
``with rpcnb.copying():`` copies tensors already in shared memory instead of sharing them
by handle, for every call this thread makes inside the block (``rpcnb.paths.zerocopy``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from rpcnb import machine
from rpcnb.errors import (
    CompositeRemoteError,
    RemoteError,
    RpcnbError,
    WorkerDiedError,
    WorkerUnreachableError,
)
from rpcnb.session.members import Group
from rpcnb.session.state import ALL

machine.check_platform(sys.platform)  # Linux only: one clear sentence elsewhere

if TYPE_CHECKING:
    from rpcnb.api import (
        add_workers,
        group,
        init,
        interrupt,
        jobs,
        join,
        restart,
        run,
        run_bg,
        shutdown,
    )
    from rpcnb.paths.zerocopy import copying

def _version() -> str:
    """The installed distribution's version (pyproject.toml's, the one number there is)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rpcnb")
    except PackageNotFoundError:  # a source tree on sys.path, never installed
        return "0+unknown"


__version__ = _version()
__all__ = [
    "ALL",
    "CompositeRemoteError",
    "Group",
    "RemoteError",
    "RpcnbError",
    "WorkerDiedError",
    "WorkerUnreachableError",
    "add_workers",
    "attach",
    "copying",
    "group",
    "init",
    "interrupt",
    "jobs",
    "join",
    "load_ipython_extension",
    "restart",
    "run",
    "run_bg",
    "shutdown",
]

_API = ("add_workers", "group", "init", "interrupt", "jobs", "join", "restart", "run", "run_bg",
        "shutdown")


def __getattr__(name: str) -> Any:
    # the API lives in rpcnb.api, which imports torch: load it when first asked for
    if name in _API:
        from rpcnb.procs import launch

        launch.apply_quiet_env()  # before rpcnb.api imports torch (its C++ log level)
        if name in ("init", "add_workers"):
            launch.warm_up()  # the workers' launcher imports torch while this process does
        from rpcnb import api

        found = getattr(api, name)
        if name not in ("init", "add_workers"):
            # kept: the next rpcnb.run is a plain attribute, not this function (it sits on
            # every call). init and add_workers come here each time, to warm the launcher.
            globals()[name] = found
        return found
    if name == "copying":  # rpcnb.paths.zerocopy imports no torch
        from rpcnb.paths.zerocopy import copying

        return copying
    raise AttributeError(f"module 'rpcnb' has no attribute {name!r}")


def attach(target: Any = None, **kwargs: Any) -> Any:
    """Attach again to a kept group (``target``: its name, or None for the one there is;
    ``rpcnb.api.attach``), or make the engines of a running ipyparallel cluster members
    (``target``: a Client, a Cluster, its id, PROFILE:ID, a profile name or directory;
    ``rpcnb.integrations.ipyparallel.attach``). ``%rpc_init --attach [TARGET]``.

    Returns:
        The group, this process included.
    """
    from rpcnb.procs import launch

    launch.apply_quiet_env()  # before torch is imported (its C++ log level)
    if target is None or (isinstance(target, str) and _is_kept(target)):
        from rpcnb import api

        return api.attach(target, **kwargs)
    from rpcnb.integrations.ipyparallel import attach as attach_engines

    return attach_engines(target, **kwargs)


def _is_kept(name: str) -> bool:
    from rpcnb.membership import kept

    return kept.read(name) is not None


def load_ipython_extension(ip: Any) -> None:
    """``%load_ext rpcnb``: register the magics, the RRef display and the JupyterLab
    panel's comm target (torch not imported).

    Also makes torch's RPC ship functions and classes defined in the notebook by value
    (once torch is imported), and sets ``TORCH_CPP_LOG_LEVEL=ERROR`` and
    ``TP_SOCKET_IFNAME=lo`` unless they are set; Tab and Shift-Tab in a ``%%remote`` cell
    complete and inspect from its worker's namespace. Raises nothing of its own.

    Args:
        ip: the IPython shell loading the extension (``InteractiveShell``).
    """
    from rpcnb.frontend import completion, debugging, panel, rrefs
    from rpcnb.frontend.magics import RpcMagics
    from rpcnb.paths import serialize
    from rpcnb.procs import launch

    launch.apply_quiet_env()  # before torch is imported, so TensorPipe stays quiet
    serialize.watch()
    ip.register_magics(RpcMagics)
    rrefs.register(ip)
    debugging.install(ip)  # %debug and %pdb on the worker a remote cell failed on
    panel.register(ip)
    completion.install(ip)  # Tab and Shift-Tab in a %%remote cell ask its worker


def unload_ipython_extension(ip: Any) -> None:
    """``%unload_ext rpcnb`` (and ``%reload_ext``): the kernel's own Tab and Shift-Tab
    again in ``%%remote`` cells, and IPython's own ``%debug``. A group keeps running."""
    from rpcnb.frontend import completion, debugging

    completion.uninstall(ip)
    debugging.uninstall(ip)
