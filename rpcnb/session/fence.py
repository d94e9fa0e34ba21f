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

from rpcnb import machine, waiting
from rpcnb.session import rendezvous

POLL_S = 0.25  # how often a fenced member looks for new hosts in the store
WAIT_S = 5.0  # how long a joiner waits for the fenced members to let it in
MAX_HOSTS = 2000  # addresses in one filter: 2 instructions each, of classic BPF's 4096
READ_AT_ONCE = 256  # new entries a fence reads per look
PENDING_S = 60.0  # how long an entry counted but not written yet is looked for

SO_ATTACH_FILTER = 26
_SKF_NET_OFF = -0x100000
_LD_W_ABS, _AND_K, _JEQ_K, _RET_K = 0x20, 0x54, 0x15, 0x06
_KEEP, _DROP = 0xFFFFFFFF, 0


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


def program(hosts: list[str]) -> list[tuple[int, int, int, int]]:
    """A classic BPF program that keeps IPv4 packets from ``hosts`` or 127.0.0.0/8 and
    drops the rest. Raises ValueError beyond MAX_HOSTS hosts."""
    addrs = sorted({int(ipaddress.IPv4Address(h)) for h in hosts})
    if len(addrs) > MAX_HOSTS:
        raise ValueError(f"a group's fence holds at most {MAX_HOSTS} addresses, not {len(addrs)}")
    insns = [(_LD_W_ABS, 0, 0, (_SKF_NET_OFF + 12) & 0xFFFFFFFF)]  # A = source address
    for a in addrs:  # no jump longer than one instruction, however many hosts
        insns += [(_JEQ_K, 0, 1, a), (_RET_K, 0, 0, _KEEP)]
    insns += [(_AND_K, 0, 0, 0xFF000000), (_JEQ_K, 0, 1, 0x7F000000),
              (_RET_K, 0, 0, _KEEP), (_RET_K, 0, 0, _DROP)]
    return insns


def attach(fd: int, hosts: list[str]) -> None:
    """Let only ``hosts`` and loopback reach the socket ``fd`` (replaces its filter)."""
    insns = program(hosts)
    code = (_Insn * len(insns))(*(_Insn(*i) for i in insns))
    # struct sock_fprog: the kernel copies the program during the call
    fprog = struct.pack("@HP", len(insns), ctypes.addressof(code))
    sock = socket.socket(fileno=os.dup(fd))  # the same socket: the filter is its own
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    finally:
        sock.close()


def listeners() -> dict[int, str]:
    """This process's listening IPv4 TCP sockets: fd -> socket inode."""
    return {fd: inode for inode, (fd, _, table) in machine.listening_sockets().items()
            if table == "tcp"}


def _same_socket(fd: int, inode: str) -> bool:
    """Whether ``fd`` is still that socket (a closed fd's number is soon reused)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == f"socket:[{inode}]"
    except OSError:
        return False


def _mac(secret: str, address: str) -> str:
    return hmac.new(secret.encode(), f"rpcnb-host:{address}".encode(),
                    hashlib.sha256).hexdigest()


def my_addresses(towards: str) -> list[str]:
    """The IPv4 addresses this host's members listen on and connect from: every address
    of this host, secondary ones included (a member picks its source address by route,
    which on a host with several networks need not be the address it listens on), the
    one towards the group at ``towards`` first."""
    import psutil

    found = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family == socket.AF_INET]
    found.insert(0, machine.route_source(towards))
    return list(dict.fromkeys(a for a in found if a and not ipaddress.ip_address(a).is_loopback))


def announce(store: Any, secret: str, addresses: list[str], wait: float = WAIT_S) -> bool:
    """Before joining torch's group: let this host's ``addresses`` in at every fenced
    member, and wait (at most ``wait`` s) until each has said so. False when some did not
    answer in time (a member that died without leaving)."""
    seqs = []
    for address in addresses:
        entry = f"{address} {_mac(secret, address)}"
        while True:  # a number whose entry someone else wrote first is not ours
            seq = int(store.add(rendezvous.HOSTS_KEY, 1))
            if store.compare_set(rendezvous.host_key(seq), "", entry).decode() == entry:
                break
        seqs.append(seq)
    def everyone_let_us_in() -> bool:
        fences = int(store.add(rendezvous.FENCES_KEY, 0))
        return all(int(store.add(rendezvous.host_in_key(q), 0)) >= fences for q in seqs)

    return waiting.until(everyone_let_us_in, wait, every=POLL_S / 2)


class Fence:
    """The filter on this member's TensorPipe listeners, and the thread that lets new
    hosts of the group in."""

    def __init__(self, store: Any, secret: str, fds: dict[int, str], mine: list[str]) -> None:
        self.store, self.secret, self.fds = store, secret, dict(fds)
        self.hosts = set(mine)
        self.seen = 0
        self.pending: dict[int, float] = {}  # counted, not written yet: since when
        self.lock = threading.Lock()
        self.stopped = False
        # counted first: a joiner that reads the count waits for this fence, which then
        # reads its entry (every entry from the first) in its first look
        self.store.add(rendezvous.FENCES_KEY, 1)
        self._refresh(first=True)
        self.thread = threading.Thread(target=self._watch, name="rpcnb-fence", daemon=True)
        self.thread.start()

    def _refresh(self, first: bool = False) -> None:
        """Let in what the store lists that this fence has not seen yet."""
        last = int(self.store.add(rendezvous.HOSTS_KEY, 0))
        now = time.monotonic()
        look = sorted(self.pending) + list(range(self.seen + 1,
                                                 min(last, self.seen + READ_AT_ONCE) + 1))
        self.seen = max(self.seen, min(last, self.seen + READ_AT_ONCE))
        new = []
        for seq in look:
            key = rendezvous.host_key(seq)
            since = self.pending.pop(seq, now)
            if not self.store.check([key]):  # counted, not written yet
                if now - since < PENDING_S:
                    self.pending[seq] = since
                continue
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                address, mac = self.store.get(key).decode().split()
                ipaddress.IPv4Address(address)
                if hmac.compare_digest(mac, _mac(self.secret, address)):
                    new.append((seq, address))
        with self.lock:
            if self.stopped:
                return
            grown = self.hosts | {a for _, a in new}
            if first or grown != self.hosts:
                hosts = sorted(grown)[:MAX_HOSTS]
                for fd, inode in list(self.fds.items()):
                    if _same_socket(fd, inode):
                        attach(fd, hosts)
                    else:  # closed (torch's agent is gone): nothing to fence there
                        del self.fds[fd]
                self.hosts = grown
        for seq, _ in new:
            self.store.add(rendezvous.host_in_key(seq), 1)

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_S)
            with self.lock:
                if self.stopped:
                    return
            with contextlib.suppress(Exception):  # the store went with the group
                self._refresh()

    def stop(self) -> None:
        with self.lock:
            self.stopped = True  # no filter is attached after this
        with contextlib.suppress(Exception):
            self.store.add(rendezvous.FENCES_KEY, -1)


def fence(store: Any, secret: str, before: set[str], mine: list[str]) -> Fence | None:
    """Fence the listeners this process opened since ``before`` (inodes of the listening
    sockets it had then: its TensorPipe agent's are the new ones), letting in ``mine``,
    the group's hosts in the store, and loopback. None when it opened no IPv4 listener."""
    fds = {fd: inode for fd, inode in listeners().items() if inode not in before}
    if not fds:
        return None
    return Fence(store, secret, fds, mine)
