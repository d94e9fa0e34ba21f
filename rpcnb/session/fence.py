"""Who may reach a member's TensorPipe ports in a group across hosts: the group's hosts.

TensorPipe accepts any peer that reaches its listening ports, and bytes that are not its
handshake (junk, an HTTP request, a TLS hello, a port scanner's probe) can abort the
process (``std::bad_alloc``, SIGSEGV) before rpcnb sees anything. Nothing in the process
can catch that, so in a group that other hosts can reach the packets never get there: a
classic BPF socket filter (``SO_ATTACH_FILTER``, no privilege needed) on each of this
process's TensorPipe listeners drops every packet whose source is not one of the group's
hosts or loopback. A SYN from anywhere else is dropped, so a stranger's connection never
opens (a scanner sees the port as filtered); the connections TensorPipe accepts inherit
the filter.

A host becomes one of the group's hosts when a member on it proves it knows the secret,
before it joins torch's group (``announce``): it puts its address with an HMAC of it under
the secret into the store, every fenced member checks the HMAC, lets that address in and
says so, and the joiner waits for them. Strangers can write into a ``--port`` store, but
not an address the members will accept.

What stays open: other processes on a group's host (other users there come from an
address that is let in) and the rendezvous store's port (joiners come from hosts not yet
known; torch's store survives junk). docs/security.md says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import ipaddress
import os
import socket
import struct
import threading
import time
from typing import Any

from rpcnb import machine

POLL_S = 0.25  # how often a fenced member looks for new hosts in the store
WAIT_S = 5.0  # how long a joiner waits for the fenced members to let it in
MAX_HOSTS = 250  # a classic BPF jump reaches 255 instructions ahead

SO_ATTACH_FILTER = 26
_SKF_NET_OFF = -0x100000
_LD_W_ABS, _AND_K, _JEQ_K, _RET_K = 0x20, 0x54, 0x15, 0x06


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


def program(hosts: list[str]) -> list[tuple[int, int, int, int]]:
    """A classic BPF program that keeps IPv4 packets from ``hosts`` or 127.0.0.0/8 and
    drops the rest. Raises ValueError beyond MAX_HOSTS hosts."""
    addrs = sorted({int(ipaddress.IPv4Address(h)) for h in hosts})
    if len(addrs) > MAX_HOSTS:
        raise ValueError(f"a group's fence holds at most {MAX_HOSTS} hosts, not {len(addrs)}")
    n = len(addrs)
    insns = [(_LD_W_ABS, 0, 0, (_SKF_NET_OFF + 12) & 0xFFFFFFFF)]  # A = source address
    # host i sits at index i + 1; "keep" at index n + 4
    insns += [(_JEQ_K, n + 2 - i, 0, a) for i, a in enumerate(addrs)]
    insns += [(_AND_K, 0, 0, 0xFF000000), (_JEQ_K, 1, 0, 0x7F000000),
              (_RET_K, 0, 0, 0), (_RET_K, 0, 0, 0xFFFFFFFF)]
    return insns


def attach(fd: int, hosts: list[str]) -> None:
    """Let only ``hosts`` and loopback reach the socket ``fd`` (replaces its filter)."""
    insns = program(hosts)
    code = (_Insn * len(insns))(*(_Insn(*i) for i in insns))
    fprog = struct.pack("@HP", len(insns), ctypes.addressof(code))
    sock = socket.socket(fileno=os.dup(fd))  # the same socket: the filter is its own
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    finally:
        sock.close()


def listeners() -> dict[int, str]:
    """This process's listening IPv4 TCP sockets: fd -> ``ADDR:PORT``."""
    by_inode: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(entry.path)
                if target.startswith("socket:["):
                    by_inode[target[8:-1]] = int(entry.name)
    found: dict[int, str] = {}
    try:
        with open("/proc/self/net/tcp") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in by_inode:  # 0A: LISTEN
            hexaddr, port = fields[1].split(":")
            addr = socket.inet_ntoa(bytes.fromhex(hexaddr)[::-1])
            found[by_inode[fields[9]]] = f"{addr}:{int(port, 16)}"
    return found


def _mac(secret: str, address: str) -> str:
    return hmac.new(secret.encode(), f"rpcnb-host:{address}".encode(),
                    hashlib.sha256).hexdigest()


def my_addresses(towards: str, iface: str) -> list[str]:
    """The IPv4 addresses this host's members listen on and connect from: every address
    of this host (a member picks its source address by route, which on a host with
    several networks need not be the address it listens on), the one towards the group
    at ``towards`` first."""
    found = [machine.interface_address(name) for name in [iface, *machine.interfaces()] if name]
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((towards, 9))  # UDP: picks a route, sends nothing
        found.insert(0, probe.getsockname()[0])
    except OSError:
        pass
    finally:
        probe.close()
    return list(dict.fromkeys(a for a in found if a and not ipaddress.ip_address(a).is_loopback))


def announce(store: Any, secret: str, addresses: list[str], wait: float = WAIT_S) -> bool:
    """Before joining torch's group: let this host's ``addresses`` in at every fenced
    member, and wait (at most ``wait`` s) until each has said so. False when some did not
    answer in time (a member that died without leaving)."""
    seqs = []
    for address in addresses:
        seq = int(store.add("rpcnb/hosts/n", 1))
        store.set(f"rpcnb/hosts/{seq}", f"{address} {_mac(secret, address)}")
        seqs.append(seq)
    deadline = time.monotonic() + wait
    while True:
        fences = int(store.add("rpcnb/fences", 0))
        if all(int(store.add(f"rpcnb/hosts/{q}/in", 0)) >= fences for q in seqs):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S / 2)


class Fence:
    """The filter on this member's TensorPipe listeners, and the thread that lets new
    hosts of the group in."""

    def __init__(self, store: Any, secret: str, fds: dict[int, str], mine: list[str]) -> None:
        self.store, self.secret, self.fds = store, secret, fds
        self.hosts = set(mine)
        self.seen = 0
        self.stopped = threading.Event()
        self._refresh()
        self.store.add("rpcnb/fences", 1)
        self.thread = threading.Thread(target=self._watch, name="rpcnb-fence", daemon=True)
        self.thread.start()

    def _refresh(self) -> None:
        """Let in what the store lists that this fence has not seen yet."""
        last = int(self.store.add("rpcnb/hosts/n", 0))
        new = []
        for seq in range(self.seen + 1, last + 1):
            with contextlib.suppress(Exception):
                address, mac = self.store.get(f"rpcnb/hosts/{seq}").decode().split()
                ipaddress.IPv4Address(address)
                if hmac.compare_digest(mac, _mac(self.secret, address)):
                    self.hosts.add(address)
                    new.append(seq)
        if self.seen == 0 or new:
            hosts = sorted(self.hosts)[:MAX_HOSTS]
            for fd in self.fds:
                attach(fd, hosts)
        self.seen = last
        for seq in new:
            self.store.add(f"rpcnb/hosts/{seq}/in", 1)

    def _watch(self) -> None:
        while not self.stopped.wait(POLL_S):
            with contextlib.suppress(Exception):  # the store went with the group
                self._refresh()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(2 * POLL_S + 1)
        with contextlib.suppress(Exception):
            self.store.add("rpcnb/fences", -1)


def fence(store: Any, secret: str, before: set[int], mine: list[str]) -> Fence | None:
    """Fence the listeners this process opened since ``before`` (its TensorPipe agent's),
    letting in ``mine``, the group's hosts in the store, and loopback."""
    fds = {fd: addr for fd, addr in listeners().items() if fd not in before}
    if not fds:
        return None
    return Fence(store, secret, fds, mine)
