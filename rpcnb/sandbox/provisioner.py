"""The kernel provisioner of the `rpcnb` kernelspec (jupyter_client's entry point group
``jupyter_client.kernel_provisioners``, name ``rpcnb-isolated``).

It is jupyter_client's local provisioner with one change: the kernel's ZMQ sockets are
``ipc`` sockets in a fresh 0700 directory of the user, not TCP ports on 127.0.0.1. A kernel
in the user's private network namespace (``python -m rpcnb.netns run``, the kernelspec's
argv) has no 127.0.0.1 that the front end shares, but the front end, outside, connects to
unix sockets by path; Jupyter still signs every message with the connection file's key.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from jupyter_client.provisioning import LocalProvisioner

from rpcnb.sandbox.isolation import runtime_dir

NAME = "rpcnb-isolated"


def socket_dir(env: dict[str, str] | None = None) -> str:
    """A new private directory (mode 0700) for one kernel's sockets: in the user's runtime
    directory, or in the temporary directory when that one is not usable."""
    try:
        return tempfile.mkdtemp(prefix="kernel-", dir=runtime_dir(env))
    except (OSError, RuntimeError):
        return tempfile.mkdtemp(prefix="rpcnb-kernel-")


class IsolatedProvisioner(LocalProvisioner):  # type: ignore[misc]
    """Launches the kernel locally, reachable over ipc sockets in a 0700 directory."""

    sockets: str | None = None

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        km = self.parent
        if km is not None:
            if self.sockets is None or not os.path.isdir(self.sockets):
                self.sockets = socket_dir(kwargs.get("env"))
            km.transport = "ipc"
            km.cache_ports = False  # port numbers are file names here, nothing to reserve
            km.ip = os.path.join(self.sockets, "kernel")
        return await super().pre_launch(**kwargs)  # type: ignore[no-any-return]

    async def cleanup(self, restart: bool = False) -> None:
        await super().cleanup(restart=restart)
        if not restart and self.sockets:
            shutil.rmtree(self.sockets, ignore_errors=True)
            self.sockets = None

    async def get_provisioner_info(self) -> dict[str, Any]:
        info: dict[str, Any] = await super().get_provisioner_info()
        info["sockets"] = self.sockets
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        await super().load_provisioner_info(provisioner_info)
        self.sockets = provisioner_info.get("sockets")
