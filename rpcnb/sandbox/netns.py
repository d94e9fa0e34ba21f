"""The user's private network namespace, where kernels of the `rpcnb` kernelspec and every
process they start run, out of reach of the machine's other users (docs/security.md).

A small holder process per user creates it: a user namespace (no root needed) that maps
the user to itself, with a network namespace whose only interface is ``lo``, brought up
while the holder still has the capabilities to. Its pid is in the user's runtime directory
(``rpcnb.sandbox.isolation.runtime_dir``). ``python -m rpcnb.netns run -- CMD`` enters that
namespace with setns on /proc/PID/ns/{user,net} (starting a holder first when none runs)
and execs CMD, which keeps the user's uid; where the machine forbids unprivileged
namespaces, CMD runs as it is. Either way ``$RPCNB_ISOLATION`` records what was done, for
``rpcnb.sandbox.isolation.status()``. The IPC and mount namespaces stay the machine's, so shared
memory, CUDA IPC and files work as before. The holder exits once no process has been in
its namespace for ``LINGER_S`` seconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from rpcnb.sandbox.isolation import (
    APPARMOR,
    ENV,
    FAILED,
    NO_USERNS,
    NOT_IPC,
    NOT_ISOLATED,
    SECCOMP,
    SYSCTL_DISABLED,
    SYSCTL_LIMIT,
    namespace,
    runtime_dir,
    sysctl,
)

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
IFREQ = "16sh22x"  # struct ifreq: the name, then ifr_flags; 40 bytes

PIDFILE = "holder.pid"
LOCKFILE = "holder.lock"  # held while a holder is found or started and entered
POLL_S = 2.0
LINGER_S = 30.0
START_TIMEOUT_S = 30.0


class Unavailable(RuntimeError):
    """No private namespace can be had here; the message says why."""


@dataclass(frozen=True)
class Holder:
    """The process that keeps the user's namespace: its pid and its namespaces."""

    pid: int
    user: str
    net: str


def _syscall(name: str, *args: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)  # Python 3.11 has no os.unshare / os.setns
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _seccomp_filtered() -> bool:
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
                      if ":" in line)
    except OSError:
        return False
    return fields.get("Seccomp", "0").strip() == "2"


def why_unavailable(err: OSError) -> str:
    """Why creating the namespace failed with ``err``, in the words of the setting to change."""
    unprivileged = os.geteuid() != 0
    for what, setting in (("user", "user.max_user_namespaces"), ("network", "user.max_net_namespaces")):
        if sysctl(setting) == "0":
            return SYSCTL_DISABLED.format(what=what, setting=setting, value="0")
    if unprivileged and sysctl("kernel.unprivileged_userns_clone") == "0":
        return SYSCTL_DISABLED.format(what="user", setting="kernel.unprivileged_userns_clone", value="0")
    if unprivileged and sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
        return APPARMOR
    if err.errno == errno.ENOSPC:
        return SYSCTL_LIMIT.format(user=sysctl("user.max_user_namespaces"),
                                   net=sysctl("user.max_net_namespaces"))
    if err.errno == errno.EINVAL and not Path("/proc/self/ns/user").exists():
        return NO_USERNS
    if err.errno == errno.EPERM and _seccomp_filtered():
        return SECCOMP.format(error=err)
    return FAILED.format(error=err)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(IFREQ, fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack(IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))


def _own_ids(kind: str) -> str:
    """Every id this process's user namespace has, each mapped to itself (``0 0
    4294967295`` on the machine's own namespace)."""
    lines = Path(f"/proc/self/{kind}_map").read_text().split("\n")
    return "".join(f"{first} {first} {count}\n" for first, _, count in
                   (line.split() for line in lines if line.strip()))


def _write_maps(pid: int) -> None:
    """Map the user to itself in ``pid``'s new user namespace, written from outside it:
    root maps every id it has to itself (files keep their owners); a user can map only its
    own uid and gid, and must give up setgroups first."""
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:
        uid_map, gid_map = _own_ids("uid"), _own_ids("gid")
    else:
        Path(f"/proc/{pid}/setgroups").write_text("deny")
        uid_map, gid_map = f"{uid} {uid} 1\n", f"{gid} {gid} 1\n"
    Path(f"/proc/{pid}/uid_map").write_text(uid_map)
    Path(f"/proc/{pid}/gid_map").write_text(gid_map)


def _members(net: str) -> list[int]:
    """The processes in network namespace ``net`` besides this one (those we may look at)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid() \
                and namespace("net", entry.name) == net:
            found.append(int(entry.name))
    return found


def find_holder(directory: Path) -> Holder | None:
    """The holder recorded in ``directory``, if it still runs in the namespaces it recorded
    (so a reused pid is not taken for it)."""
    try:
        data = json.loads((directory / PIDFILE).read_text())
        holder = Holder(int(data["pid"]), str(data["user"]), str(data["net"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if namespace("net", holder.pid) != holder.net or namespace("user", holder.pid) != holder.user:
        return None
    return holder


def _record_holder(directory: Path, holder: Holder) -> None:
    tmp = directory / f".{PIDFILE}.{holder.pid}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": holder.pid, "user": holder.user, "net": holder.net}, f)
    os.replace(tmp, directory / PIDFILE)


def _forget_holder(directory: Path, pid: int) -> None:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        if json.loads((directory / PIDFILE).read_text())["pid"] == pid:
            (directory / PIDFILE).unlink()


@contextlib.contextmanager
def _locked(directory: Path, blocking: bool = True) -> Iterator[bool]:
    fd = os.open(directory / LOCKFILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _holder_main(directory: Path, to_parent: int, from_parent: int) -> NoReturn:
    """The holder itself, a forked child that never returns into its caller's code."""
    code = 1
    try:
        code = _hold(directory, to_parent, from_parent)
    except BaseException as err:  # noqa: B036 - said to the parent, then _exit
        with contextlib.suppress(OSError):
            os.write(to_parent, FAILED.format(error=err).encode())
    finally:
        os._exit(code)


def _hold(directory: Path, to_parent: int, from_parent: int) -> int:
    """Create the namespaces, wait for the parent to write the id maps, bring ``lo`` up,
    record the pid, then keep the namespace while it is used."""
    os.setsid()
    try:
        _syscall("unshare", CLONE_NEWUSER | CLONE_NEWNET)
    except OSError as err:
        os.write(to_parent, why_unavailable(err).encode())
        return 1
    os.write(to_parent, b"unshared\n")
    if os.read(from_parent, 16) != b"mapped\n":
        return 1
    try:
        _loopback_up()
    except OSError as err:
        os.write(to_parent, why_unavailable(err).encode())
        return 1
    me = Holder(os.getpid(), str(namespace("user")), str(namespace("net")))
    _record_holder(directory, me)

    def stop(signum: int, frame: object) -> None:
        _forget_holder(directory, me.pid)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.chdir("/")
    os.write(to_parent, b"ready\n")
    os.close(to_parent)
    _linger(directory, me)
    return 0


def _linger(directory: Path, me: Holder) -> None:
    """Keep the namespace while processes are in it; return once none has been for
    LINGER_S seconds and no launcher is about to enter it (the lock)."""
    idle_since: float | None = None
    # a heartbeat, not a wait for one thing (rpcnb.waiting): each look decides anew (anyone
    # in the namespace, idle for how long, a launcher holding the lock)
    while True:
        time.sleep(POLL_S)
        if _members(me.net):
            idle_since = None
            continue
        idle_since = idle_since or time.monotonic()
        if time.monotonic() - idle_since < LINGER_S:
            continue
        with _locked(directory, blocking=False) as locked:
            if locked and not _members(me.net):
                _forget_holder(directory, me.pid)
                return
        idle_since = None


def hold(directory: Path) -> int:
    """``python -m rpcnb.netns hold DIR``: start a holder (a daemon, not this process's
    child once this returns) and return 0 when its namespace is ready, or 1 with the
    reason on stderr."""
    to_parent_r, to_parent_w = os.pipe()
    to_child_r, to_child_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(to_parent_r)
        os.close(to_child_w)
        _holder_main(directory, to_parent_w, to_child_r)
    os.close(to_parent_w)
    os.close(to_child_r)
    with os.fdopen(to_parent_r, "rb") as from_child, os.fdopen(to_child_w, "wb", buffering=0) as to_child:
        said = from_child.readline()
        if said == b"unshared\n":
            try:
                _write_maps(pid)
            except OSError as err:
                to_child.write(b"failed\n")
                said = why_unavailable(err).encode()
            else:
                to_child.write(b"mapped\n")
                said = from_child.readline()
    if said == b"ready\n":
        return 0
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    sys.stderr.write(said.decode(errors="replace").strip() or FAILED.format(
        error="the namespace holder exited before it was ready"))
    return 1


def start_holder(directory: Path) -> Holder:
    """Start a holder for ``directory`` and wait until its namespace is ready."""
    proc = subprocess.run([sys.executable, "-m", "rpcnb.netns", "hold", str(directory)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=START_TIMEOUT_S, start_new_session=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise Unavailable(lines[-1] if lines else FAILED.format(
            error=f"the namespace holder exited with code {proc.returncode}"))
    holder = find_holder(directory)
    if holder is None:
        raise Unavailable(FAILED.format(error="the namespace holder is gone"))
    return holder


def enter(holder: Holder) -> None:
    """Move this (single-threaded) process into ``holder``'s user and network namespaces."""
    for kind, flag, expected in (("user", CLONE_NEWUSER, holder.user), ("net", CLONE_NEWNET, holder.net)):
        if namespace(kind) == expected:
            continue  # already there (started from inside the namespace)
        fd = os.open(f"/proc/{holder.pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != expected:
                raise Unavailable(FAILED.format(error=f"process {holder.pid} is no longer the holder"))
            _syscall("setns", fd, flag)
        finally:
            os.close(fd)
    if namespace("net") != holder.net:
        raise Unavailable(FAILED.format(error=f"setns left this process in {namespace('net')}"))


def join(env: dict[str, str] | None = None) -> Holder:
    """Enter the user's namespace, starting its holder first when none runs."""
    directory = runtime_dir(env)
    with _locked(directory):
        holder = find_holder(directory) or start_holder(directory)
        enter(holder)
    return holder


def _transport(cmd: list[str]) -> str | None:
    """The ZMQ transport in the kernel's connection file (``-f FILE`` in ``cmd``), if any."""
    for i, arg in enumerate(cmd[:-1]):
        if arg == "-f":
            try:
                return str(json.loads(Path(cmd[i + 1]).read_text()).get("transport", "tcp"))
            except (OSError, ValueError, AttributeError):
                return None
    return None


def place(cmd: list[str]) -> dict[str, Any]:
    """Put this process where ``cmd`` should run and say what was done (``$RPCNB_ISOLATION``)."""
    transport = _transport(cmd)
    if transport not in (None, "ipc"):
        return {"isolated": False, "why": NOT_IPC.format(transport=transport)}
    try:
        holder = join()
    except (Unavailable, RuntimeError) as err:
        return {"isolated": False, "why": str(err)}
    except (OSError, subprocess.SubprocessError) as err:
        return {"isolated": False, "why": FAILED.format(error=err)}
    return {"isolated": True, "net": holder.net, "holder": holder.pid}


def run(cmd: list[str]) -> NoReturn:
    """``python -m rpcnb.netns run -- CMD``: exec CMD in the user's namespace (or, where
    there is none to be had, as it is); a bare ``python`` is this interpreter."""
    env = dict(os.environ)
    placed = place(cmd)
    env[ENV] = json.dumps(placed)
    if not placed["isolated"]:  # said at once in the front end's log, and at %rpc_init
        print(NOT_ISOLATED.format(why=placed["why"]), file=sys.stderr, flush=True)
    if cmd[0] in ("python", "python3", f"python3.{sys.version_info[1]}"):
        cmd = [sys.executable, *cmd[1:]]
    os.execvpe(cmd[0], cmd, env)


def describe(directory: Path) -> str:
    """The holder and who is in its namespace, for ``python -m rpcnb.netns status``."""
    holder = find_holder(directory)
    if holder is None:
        return f"no namespace holder runs for {directory}"
    members = [pid for pid in _members(holder.net) if pid != holder.pid]
    return (f"holder {holder.pid} keeps {holder.net} ({holder.user}); processes in it "
            f"besides the holder: {' '.join(map(str, members)) or 'none'}")


USAGE = "usage: python -m rpcnb.netns run -- CMD... | hold DIR | status"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["run"]:
        cmd = args[2:] if args[1:2] == ["--"] else args[1:]
        if cmd:
            run(cmd)
    elif args[:1] == ["hold"] and len(args) == 2:
        return hold(Path(args[1]))
    elif args == ["status"]:
        print(describe(runtime_dir()))
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
