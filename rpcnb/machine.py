"""What this machine and this process have: CUDA devices, network interfaces, /dev/shm,
InfiniBand, and the facts TensorPipe decides its transports and channels by.

Everything rpcnb asks about the machine is asked here, once per question. torch is
imported only by the functions that need it (the CUDA ones).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import ipaddress
import os
import socket
from dataclasses import asdict, dataclass, field
from typing import Any

from rpcnb import settings

UNSUPPORTED = (
    "rpcnb runs on Linux only, and this is {platform!r}: it uses Linux's /proc, /dev/shm, "
    "cross-memory attach and network namespaces. Run the notebook's kernel on a Linux "
    "machine (a remote kernel, WSL 2 on Windows, or a Linux container); see {where}."
)


class UnsupportedPlatform(ImportError):
    """rpcnb was imported on a platform it does not run on (anything but Linux)."""


def check_platform(platform: str) -> None:
    """Refuse, in one sentence, a platform other than Linux (``sys.platform``)."""
    if not platform.startswith("linux"):
        from rpcnb import docs

        raise UnsupportedPlatform(UNSUPPORTED.format(platform=platform,
                                                     where=docs.ref("getting-started", "platforms")))


BAD_HOST = "--host {host!r} is not an IP address of this machine: {reason}."
SHM_DIR = "/dev/shm"


# --------------------------------------------------------------------------- devices


def cuda_devices() -> list[str]:
    """This process's CUDA devices as ``["cuda:0", ...]`` (empty without a GPU, and
    without initialising CUDA when torch has no CUDA at all). Imports torch."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def gpu_memory() -> list[dict[str, Any]]:
    """Each CUDA device's memory as this process uses it: ``{"device", "allocated",
    "reserved", "total"}`` (bytes; torch's caching allocator). Empty without a GPU. A
    process that has not initialised CUDA holds none, and is not made to initialise it here
    (a context costs hundreds of MB): its devices show 0 used and ``total`` None."""
    import torch

    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        if torch.cuda.is_initialized():
            found.append({"device": f"cuda:{i}", "allocated": torch.cuda.memory_allocated(i),
                          "reserved": torch.cuda.memory_reserved(i),
                          "total": torch.cuda.get_device_properties(i).total_memory})
        else:
            found.append({"device": f"cuda:{i}", "allocated": 0, "reserved": 0, "total": None})
    return found


def visible_gpu_ids(count: int | None = None) -> list[str]:
    """How this process's GPUs are named in CUDA_VISIBLE_DEVICES (indices or UUIDs), in
    the order torch numbers them: what a child process gets to see one of them."""
    if count is None:
        count = len(cuda_devices())
    if not settings.is_set("CUDA_VISIBLE_DEVICES"):
        return [str(i) for i in range(count)]
    listed = settings.other("CUDA_VISIBLE_DEVICES")
    return [item.strip() for item in listed.split(",") if item.strip()][:count]


def ib_devices() -> list[str]:
    """InfiniBand devices (``/sys/class/infiniband``), sorted; empty when there are none."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def give_back_memory() -> None:
    """Return freed heap memory to the system (glibc's malloc_trim; nothing elsewhere),
    after something large was freed. Large strings freed by threads of their own (RPC
    threads) stay in per-thread arenas otherwise, and the process keeps their size."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


def shm_free_bytes(path: str = SHM_DIR) -> int:
    """Bytes free in ``/dev/shm`` for this user (0 when it is missing)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


# --------------------------------------------------------------------------- network


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as psutil gives it (an IPv6 one may end in ``%zone``)."""
    return ipaddress.ip_address(address.split("%", 1)[0])


def interface_of(host: str) -> str:
    """The network interface that owns ``host``, an IPv4 or IPv6 address (for
    TP_SOCKET_IFNAME): named as getifaddrs names it (``psutil.net_if_addrs``), which is
    how TensorPipe looks the variable up."""
    import psutil

    wanted = ipaddress.ip_address(host)
    if wanted.is_loopback:
        return "lo"
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and _ip(a.address) == wanted
               for a in addresses):
            return name
    raise ValueError(BAD_HOST.format(host=host, reason="no interface has that address"))


NO_INTERFACE = (
    "There is no network interface {name!r} here (this machine has {known}): give one of "
    "those with --interface."
)


def interfaces() -> list[str]:
    """This machine's network interfaces, by name: the kernel's list (``if_nameindex``),
    each interface once, with or without an address."""
    return [name for _, name in socket.if_nameindex()]


def check_interface_name(name: str) -> str:
    """``name`` if this machine has that interface (ValueError NO_INTERFACE otherwise)."""
    known = interfaces()
    if name not in known:
        raise ValueError(NO_INTERFACE.format(name=name, known=", ".join(known)))
    return name


def interface_address(name: str) -> str:
    """The (first) IPv4 address of interface ``name`` ('' when it has none)."""
    import psutil

    return next((a.address for a in psutil.net_if_addrs().get(name, ())
                 if a.family == socket.AF_INET), "")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        return False


def listening_sockets() -> dict[str, tuple[int, str, str]]:
    """This process's listening TCP sockets (psutil, which reads the tables of this
    process's network namespace): socket inode -> (fd, ``ADDR:PORT``, ``"tcp"`` or
    ``"tcp6"``); {} when psutil cannot tell."""
    import psutil

    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return {}
    found = {}
    for c in conns:
        if c.status != psutil.CONN_LISTEN or c.fd < 0:
            continue
        try:
            inode = os.fstat(c.fd).st_ino  # a socket's inode: /proc/self/fd's "socket:[N]"
        except OSError:
            continue  # closed meanwhile
        table = "tcp6" if c.family == socket.AF_INET6 else "tcp"
        found[str(inode)] = (c.fd, f"{ipaddress.ip_address(c.laddr.ip)}:{c.laddr.port}", table)
    return found


def route_source(host: str, port: int = 9) -> str:
    """The address this machine would send from to reach ``host`` ('' when it has no
    route there)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, port))  # UDP: picks a route, sends nothing
        return str(probe.getsockname()[0])
    except OSError:
        return ""
    finally:
        probe.close()


def interface_towards(host: str, port: int) -> str:
    """The interface this machine would use to reach ``host`` (for a remote joiner)."""
    if is_loopback(host):
        return "lo"
    source = route_source(host, port)
    if not source:
        raise OSError(f"no route to {host}")
    return interface_of(source)


def heard_from(address: str) -> float | None:
    """Seconds since this process last received anything (data, or the acknowledgement of
    what it sent) over any of its TCP connections with ``address``; None when it holds no
    connection there (or cannot tell). The peer host's kernel acknowledges what arrives
    even while the peer process is busy or stopped, so a recent answer here means that
    host is reachable: ``tcp_info``'s ``last_data_recv`` and ``last_ack_recv``."""
    import struct

    import psutil

    want = address.strip("[]").removeprefix("::ffff:")
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    best: float | None = None
    for c in conns:
        if not c.raddr or c.fd < 0 or c.raddr.ip.removeprefix("::ffff:") != want:
            continue
        try:
            with socket.fromfd(c.fd, c.family, socket.SOCK_STREAM) as sk:  # a dup, ours to close
                info = sk.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        except OSError:
            continue
        if len(info) < 60:
            continue
        # struct tcp_info: 8 bytes of u8 fields, 13 u32, then last_data_recv, last_ack_recv
        data_ms, ack_ms = struct.unpack_from("=II", info, 52)
        ago = min(data_ms, ack_ms) / 1000.0
        best = ago if best is None else min(best, ago)
    return best


# --------------------------------------------------------------------------- facts


@dataclass
class Facts:
    """What one member reports: everything TensorPipe decides a pipe by."""

    name: str
    host: str
    pid: int
    boot_id: str
    net_ns: str
    pid_ns: str
    user_ns: str
    uids: tuple[int, int, int]  # real, effective, saved-set
    gids: tuple[int, int, int]
    dumpable: bool
    cap_permitted: str  # CapPrm from /proc/self/status
    lsms: list[str] | None  # /sys/kernel/security/lsm; None when unreadable
    ptrace_scope: int | None  # yama; None when yama is absent
    cma_selftest: bool  # process_vm_readv on itself works (no seccomp filter)
    memfd: bool  # a 1 MB memfd can be created and mapped (shm transport)
    ibverbs: bool  # libibverbs loads
    ib_devices: list[str]
    socket_ifname: str  # TP_SOCKET_IFNAME ('' when unset)
    cuda_built: bool  # this torch has CUDA channels at all
    cuda_devices: list[dict[str, Any]] = field(default_factory=list)  # index, uuid, name
    p2p: dict[str, dict[str, bool]] = field(default_factory=dict)  # uuid -> uuid -> ok
    nv_peer_mem: bool = False
    transports: list[str] | None = None  # the _transports it was started with
    channels: list[str] | None = None  # the _channels it was started with
    torch: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Facts:
        data = dict(data)
        data["uids"] = tuple(data["uids"])
        data["gids"] = tuple(data["gids"])
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_file(path: str) -> str | None:
    """A small file's text, stripped (``/proc``, ``/sys``), or None if it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _ns(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


@functools.cache
def _libc() -> Any:
    # by its soname first: ctypes.util.find_library runs `ldconfig -p` (a process) per call
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def cma_selftest() -> bool:
    """What TensorPipe checks: process_vm_readv on ourselves (only seccomp can refuse)."""
    try:
        libc = _libc()
        src = ctypes.c_uint64(0x0123456789ABCDEF)
        dst = ctypes.c_uint64(0)
        local = _IoVec(ctypes.cast(ctypes.byref(dst), ctypes.c_void_p), 8)
        remote = _IoVec(ctypes.cast(ctypes.byref(src), ctypes.c_void_p), 8)
        libc.process_vm_readv.restype = ctypes.c_ssize_t
        n = libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        return bool(n == 8 and dst.value == src.value)
    except (OSError, AttributeError):
        return False


def _dumpable() -> bool:
    try:
        return bool(_libc().prctl(3, 0, 0, 0, 0) == 1)  # PR_GET_DUMPABLE; SUID_DUMP_USER
    except (OSError, AttributeError):
        return False


def _memfd_works() -> bool:
    import mmap

    try:
        fd = os.memfd_create("rpcnb-shm-check", getattr(os, "MFD_CLOEXEC", 1))
    except (OSError, AttributeError):
        return False
    try:
        os.ftruncate(fd, 1 << 20)
        mm = mmap.mmap(fd, 1 << 20)
        mm[0] = 1
        mm.close()
        return True
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)


def _cap_permitted() -> str:
    for line in (read_file("/proc/self/status") or "").splitlines():
        if line.startswith("CapPrm:"):
            return line.split()[1]
    return ""


def _ibverbs() -> bool:
    try:
        ctypes.CDLL("libibverbs.so.1")
        return True
    except OSError:
        return False


def _cuda_facts() -> tuple[bool, list[dict[str, Any]], dict[str, dict[str, bool]]]:
    import torch

    built = torch.version.cuda is not None
    if not (built and torch.cuda.is_available()):
        return built, [], {}
    devices: list[dict[str, Any]] = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        devices.append({"index": i, "uuid": str(getattr(props, "uuid", f"index-{i}")),
                        "name": props.name})
    p2p: dict[str, dict[str, bool]] = {}
    for a in devices:
        row = p2p.setdefault(a["uuid"], {})
        for b in devices:
            row[b["uuid"]] = a is b or bool(torch.cuda.can_device_access_peer(a["index"], b["index"]))
    return built, devices, p2p


@functools.cache
def _fixed_facts() -> dict[str, Any]:
    """The facts that are fixed while the process lives: read once, at the first call."""
    import torch

    scope = read_file("/proc/sys/kernel/yama/ptrace_scope")
    lsm = read_file("/sys/kernel/security/lsm")
    built, devices, p2p = _cuda_facts()
    return Facts(
        name="", host=socket.gethostname(), pid=os.getpid(),
        boot_id=read_file("/proc/sys/kernel/random/boot_id") or "",
        net_ns=_ns("net"), pid_ns=_ns("pid"), user_ns=_ns("user"),
        uids=os.getresuid(), gids=os.getresgid(), dumpable=_dumpable(),
        cap_permitted=_cap_permitted(),
        lsms=[x for x in lsm.split(",") if x] if lsm is not None else None,
        ptrace_scope=int(scope) if scope and scope.isdigit() else None,
        cma_selftest=cma_selftest(), memfd=_memfd_works(), ibverbs=_ibverbs(),
        ib_devices=ib_devices(), socket_ifname=settings.other("TP_SOCKET_IFNAME"),
        cuda_built=built, cuda_devices=devices, p2p=p2p,
        nv_peer_mem=any(os.path.exists(f"/sys/module/{m}")
                        for m in ("nv_peer_mem", "nvidia_peermem")),
        torch=torch.__version__,
    ).to_dict()


def process_facts() -> dict[str, Any]:
    """This process's facts as a plain dict, without its name and TensorPipe settings
    (the group fills those in). Read once per process, at the first call: they are fixed
    while the process lives; only ``TP_SOCKET_IFNAME`` is read each time (a kernel's
    later group may listen elsewhere)."""
    return dict(_fixed_facts(), socket_ifname=settings.other("TP_SOCKET_IFNAME"))
