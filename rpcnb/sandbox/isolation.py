"""Whether this process is shut off from the machine's other users: kernels of the `rpcnb`
kernelspec run in a private network namespace of the user (``rpcnb.sandbox.netns`` makes it), where
nobody else can see or reach TensorPipe's ports. ``status()`` says whether this process is
in it, from facts the process checks itself, and if it is not, why.

Only the standard library: the launcher, the kernel provisioner and every layer of rpcnb
may use this module.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpcnb import docs, settings

# What the launcher did, for this process and everything it starts (JSON): either
# {"isolated": true, "net": "net:[...]", "holder": PID} or {"isolated": false, "why": "..."}.
ENV = "RPCNB_ISOLATION"
# Where the namespace holder keeps its pid (and the kernels their sockets); see runtime_dir.
RUNTIME_ENV = "RPCNB_RUNTIME_DIR"
KERNEL_NAME = "rpcnb"
DISPLAY_NAME = "Python 3 (rpcnb)"

# The initial user namespace has this fixed inode number (PROC_USER_INIT_INO, Linux >= 3.8).
INIT_USER_NS = "user:[4026531837]"

ISOLATED = (
    "private network namespace {net} shared by this user's rpcnb kernels: only 'lo' in it, "
    "and no other user of the machine can see or reach its ports"
)
NOT_RPCNB_KERNEL = (
    "this is not an rpcnb kernel (kernel {name!r}): start the notebook on 'Python 3 (rpcnb)'"
)
NOT_STARTED_BY_RPCNB = (
    "this process was not started by an rpcnb kernel: start the notebook on 'Python 3 (rpcnb)'"
)
LEFT_NAMESPACE = (
    "this process is no longer in the namespace its kernel started in (it was {expected}, "
    "it is {actual}): restart the kernel"
)
NOT_PRIVATE = (
    "the network namespace {net} is not private: it has interfaces besides 'lo' ({names})"
)
HOST_USER_NS = "this process runs in the machine's own user namespace, not a private one"
NOT_IPC = (
    "the front end started this kernel without rpcnb's kernel provisioner (transport "
    "{transport!r}; VS Code does so), and a kernel in a private namespace can only be "
    "reached over ipc sockets, so this kernel is not isolated: for isolation use JupyterLab "
    "or Jupyter Notebook (jupyter_client >= 7) with rpcnb installed in the front end's "
    "environment"
)
NOT_ISOLATED = "rpcnb: the 'Python 3 (rpcnb)' kernel is NOT isolated: {why}."
SYSCTL_DISABLED = "unprivileged {what} namespaces are disabled here ({setting}={value})"
SYSCTL_LIMIT = (
    "the limit on namespaces is reached here (user.max_user_namespaces={user}, "
    "user.max_net_namespaces={net})"
)
APPARMOR = (
    "AppArmor forbids unprivileged user namespaces here "
    "(kernel.apparmor_restrict_unprivileged_userns=1)"
)
SECCOMP = (
    "a seccomp filter forbids creating namespaces here (a container's default profile does): "
    "{error}"
)
NO_USERNS = "this Linux kernel has no user or network namespaces (CONFIG_USER_NS, CONFIG_NET_NS)"
FAILED = "creating a private network namespace failed: {error}"
NOTICE = (
    "Note: this group's ports are open to every user of this machine, because {why}. "
    "See " + docs.ref("security") + "."
)
RUNTIME_NOT_PRIVATE = (
    "{path} is not a private directory of yours ({detail}): remove it, or set "
    "RPCNB_RUNTIME_DIR to a directory only you can use"
)


@dataclass(frozen=True)
class Isolation:
    """Whether this process is in rpcnb's private network namespace, and why (not)."""

    isolated: bool
    why: str
    namespace: str | None = None  # "net:[4026532...]" when isolated

    def __str__(self) -> str:
        return ("isolated: " if self.isolated else "not isolated: ") + self.why


def namespace(kind: str, pid: int | str = "self") -> str | None:
    """``net:[4026532178]``: the namespace of ``kind`` that ``pid`` is in (None if unreadable)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def interfaces() -> list[str]:
    """The network interfaces of this process's network namespace (/proc/self/net/dev)."""
    lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    return sorted(line.split(":", 1)[0].strip() for line in lines if ":" in line)


def sysctl(name: str) -> str | None:
    """The value of sysctl ``name`` (dotted, as ``sysctl`` prints it), None where absent."""
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """This user's private directory for the namespace holder and the kernels' sockets:
    ``$RPCNB_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/rpcnb``, else ``/tmp/rpcnb-run-<uid>``.
    Created with mode 0700; one that another user owns or can enter raises RuntimeError."""
    env = os.environ if env is None else env
    if settings.text(RUNTIME_ENV, env):
        path = Path(settings.text(RUNTIME_ENV, env))
    elif env.get("XDG_RUNTIME_DIR"):
        path = Path(env["XDG_RUNTIME_DIR"]) / "rpcnb"
    else:
        path = Path(tempfile.gettempdir()) / f"rpcnb-run-{os.geteuid()}"
    path = path.absolute()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    detail = None
    if not stat.S_ISDIR(info.st_mode):
        detail = "not a directory"
    elif info.st_uid != os.geteuid():
        detail = f"owned by uid {info.st_uid}"
    elif info.st_mode & 0o077:
        detail = f"mode {stat.S_IMODE(info.st_mode):o}"
    if detail:
        raise RuntimeError(RUNTIME_NOT_PRIVATE.format(path=path, detail=detail))
    return path


def _record() -> dict[str, Any] | None:
    try:
        record = json.loads(settings.text(ENV) or "null")
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _kernel_name() -> str | None:
    """The kernelspec this process was started from, read from its connection file (``-f``),
    as Jupyter front ends write it; None when this is not a kernel."""
    argv = sys.argv
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "-f" and i + 1 < len(argv) else (
            arg[4:] if arg.startswith("--f=") else None)
        if path:
            try:
                name = json.loads(Path(path).read_text()).get("kernel_name")
            except (OSError, ValueError, AttributeError):
                return None
            return str(name) if name else None
    return None


def status() -> Isolation:
    """Whether this process (a kernel, or a worker it started) runs in the user's private
    network namespace. The launcher's note in ``$RPCNB_ISOLATION`` says where it put the
    process; the process then checks that it is still there, that the namespace has no
    interface but ``lo``, and that it is not the machine's own user namespace."""
    record = _record()
    if record is None:
        name = _kernel_name()
        if name and name != KERNEL_NAME:
            return Isolation(False, NOT_RPCNB_KERNEL.format(name=name))
        return Isolation(False, NOT_STARTED_BY_RPCNB)
    if not record.get("isolated"):
        return Isolation(False, str(record.get("why") or FAILED.format(error="unknown")))
    expected, actual = str(record.get("net")), namespace("net")
    if actual != expected:
        return Isolation(False, LEFT_NAMESPACE.format(expected=expected, actual=actual))
    if namespace("user") in (None, INIT_USER_NS):
        return Isolation(False, HOST_USER_NS)
    names = interfaces()
    if names != ["lo"]:
        return Isolation(False, NOT_PRIVATE.format(net=actual, names=", ".join(names)))
    return Isolation(True, ISOLATED.format(net=actual), actual)


@dataclass
class _Notice:
    """Whether this process gave its notice (``notice``): the process's, given once."""

    given: bool = False


_NOTICE = _Notice()


def notice() -> str | None:
    """The sentence to show the first time a group starts in a process that is not
    isolated; None when it is isolated, or once the sentence was given."""
    if _NOTICE.given:
        return None
    _NOTICE.given = True
    found = status()
    return None if found.isolated else NOTICE.format(why=found.why)


if __name__ == "__main__":  # pragma: no cover - `python -m rpcnb.sandbox.isolation`
    print(status())
