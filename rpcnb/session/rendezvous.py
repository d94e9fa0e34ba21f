"""Where a group meets, and who may enter: the rendezvous store, the connection file and
the group secret.

By default the store is a file in a private directory (``file://``): it listens nowhere
and only this user can reach it. ``--port`` makes it a TCP store bound to one address
(loopback unless ``--allow-remote``). Either way the group has a random secret, kept in
``connection.json`` (mode 0600) beside the store, like a Jupyter connection file. A
member proves it knows the secret when it joins, and every rpcnb request carries a token
derived from it; TensorPipe's own port still accepts any peer that reaches it.
"""

from __future__ import annotations

import datetime
import errno
import functools
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpcnb import docs, errors
from rpcnb.errors import RpcnbError
from rpcnb.machine import BAD_HOST

CONNECTION_FILE = "connection.json"

PORT_BUSY = (
    "Port {port} on {host} is busy: pick another with --port, or leave --port out to "
    "meet through a private file instead."
)
REMOTE_NEEDS_FLAG = (
    "--host {host} is not a loopback address: anyone who reaches it can run code in this "
    "group (TensorPipe and the store do not authenticate); add --allow-remote to accept that."
)
NEEDS_SECRET = (
    "Joining {addr} needs the group's secret: pass the connection file that %rpc_init "
    "printed (--join PATH/connection.json), or --token TOKEN."
)
REFUSED = (
    "{leader} refused this kernel: it does not know the group's secret. Use the "
    "connection file or the token that %rpc_init printed."
)
BAD_TOKEN = "rpcnb refused a request that did not carry the group's secret"
UNSIGNED = (
    "rpcnb refused a message that was not signed with the group's secret (a process "
    "outside the group, or another rpcnb version)"
)
OTHER_NETNS = (
    "The group at {addr} runs in another network namespace ({theirs}; this kernel is in "
    "{mine}), so its members cannot reach this kernel: join from a kernel of the same kind "
    "(both on 'Python 3 (rpcnb)', or both not)."
)
WRONG_SECRET = (
    "The secret given for {addr} is not that group's: use the connection file or the "
    "token that %rpc_init printed on the group's first kernel."
)
OTHER_PROTOCOL = (
    "The group at {addr} speaks rpcnb protocol {theirs} and this kernel speaks {mine}: "
    "install the same rpcnb version in every member's environment."
)
REMOTE_EXPOSES = (
    "rpcnb: the group listens on {host} (store port {port}, TensorPipe on {iface}). Anyone "
    "who reaches that address can connect to TensorPipe and run code: use it on a private "
    "network only. Joins and rpcnb requests need the token; see " + docs.ref("security") + "."
)


@dataclass(frozen=True)
class Connection:
    """What a member needs to join: the store's address and the group's secret."""

    address: str  # file:///.../store or tcp://host:port
    secret: str
    leader: str
    path: Path | None = None  # the connection file, when there is one

    @property
    def group_id(self) -> str:
        return hashlib.sha256(self.address.encode()).hexdigest()[:8] if self.is_tcp \
            else Path(self.address[len("file://"):]).parent.name.removeprefix("rpcnb-")

    @property
    def is_tcp(self) -> bool:
        return self.address.startswith("tcp://")


def new_secret() -> str:
    return secrets.token_hex(16)


def proof(secret: str, name: str, rank: int) -> str:
    """What a joining member sends to show it knows the secret."""
    return hmac.new(secret.encode(), f"join:{name}:{rank}".encode(), hashlib.sha256).hexdigest()


def call_token(secret: str) -> str:
    """The token every rpcnb request carries (derived, so the secret itself never travels)."""
    return hmac.new(secret.encode(), b"rpcnb-call", hashlib.sha256).hexdigest()[:32]


def verify(expected: str, given: Any) -> bool:
    return isinstance(given, str) and hmac.compare_digest(expected, given)


# Every Python payload a member sends (calls, remote creations, results, RRef fetches,
# remote exceptions) is signed with a key derived from the secret and checked before it
# is unpickled (rpcnb.paths.serialize). The protocol number changes whenever rpcnb's requests,
# signatures or messages' forms do (4: a tensor in a message is rpcnb.paths.routes's
# tensor_at); members with another one are refused before they join torch's group.
# The signature is keyed BLAKE2b (RFC 7693: a MAC by design, without HMAC's two passes),
# a 256-bit tag: half the time of HMAC-SHA256 on the small messages most calls are.
PROTOCOL = "4"
SIGNATURE = b"rpcnb-sig2:"  # then the 32-byte keyed BLAKE2b, the sender's name, the pickle
_MAC_END = len(SIGNATURE) + 32


def sign_key(secret: str) -> bytes:
    """The key Python payloads are signed with."""
    return hmac.new(secret.encode(), b"rpcnb-sign", hashlib.sha256).digest()


def key_check(secret: str) -> str:
    """What the leader puts in the store so a joiner can tell, before it joins, whether
    it has the group's secret (an HMAC: the store's readers learn nothing from it)."""
    return hmac.new(secret.encode(), b"rpcnb-keycheck", hashlib.sha256).hexdigest()[:32]


def sign(key: bytes, sender: str, payload: bytes) -> bytes:
    """``payload`` with its signature, saying who sent it (the name is signed too). The
    payload is copied once, into the message."""
    base, head = _signer(key, sender)
    h = base.copy()
    h.update(payload)
    return b"".join((SIGNATURE, h.digest(), head, payload))


# The tag is keyed BLAKE2b over the head (the sender's name, with its length) and then the
# payload. A keyed state that has already taken a head is kept, per key and head, and
# copied for each message: a keyed init hashes the key's block each time, and a member
# sends and receives under a handful of names. Each cache is bounded: a stranger's
# messages can add heads to the receiver's (they fail the tag), pushing out the oldest.
_TABLE_MAX = 64


def _headed(key: bytes, head: bytes) -> Any:
    h = hashlib.blake2b(key=key, digest_size=32)
    h.update(head)
    return h


@functools.lru_cache(maxsize=_TABLE_MAX)
def _signer(key: bytes, sender: str) -> tuple[Any, bytes]:
    """The keyed state that has taken ``sender``'s head, and the head."""
    name = sender.encode()
    head = bytes((len(name),)) + name
    return _headed(key, head), head


@functools.lru_cache(maxsize=_TABLE_MAX)
def _checker(key: bytes, head: bytes) -> tuple[Any, str]:
    """The keyed state that has taken ``head``, and the sender it names."""
    return _headed(key, head), head[1:].decode(errors="replace")


def unsign(key: bytes, data: bytes) -> tuple[str, Any] | None:
    """(sender, payload) of ``data`` if its signature is ``key``'s, else None. The
    payload is a view into ``data`` (not a copy)."""
    if len(data) < _MAC_END + 1 or not data.startswith(SIGNATURE):
        return None
    end = _MAC_END + 1 + data[_MAC_END]
    head = data[_MAC_END:end]
    base, sender = _checker(key, head)
    view = memoryview(data)
    h = base.copy()
    h.update(view[end:])
    if not hmac.compare_digest(view[len(SIGNATURE):_MAC_END], h.digest()):
        return None
    return sender, view[end:]


def write_connection(group_dir: Path, conn: Connection) -> Path:
    path = group_dir / CONNECTION_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"address": conn.address, "secret": conn.secret, "leader": conn.leader,
                   "netns": network_namespace(), "leader_pid": os.getpid(),
                   "boot_id": _boot_id()}, f)
    return path


def read_connection(where: str, token: str | None = None) -> Connection:
    """A connection from ``--join WHERE``: a connection file, its directory, a file://
    store (the file beside it) or tcp://host:port together with ``token``."""
    where = where.strip()
    if where.startswith("tcp://"):
        if not token:
            raise RpcnbError(NEEDS_SECRET.format(addr=where))
        return Connection(where, token, leader="")
    path = Path(where[len("file://"):] if where.startswith("file://") else where).expanduser()
    if path.is_dir():
        path = path / CONNECTION_FILE
    elif path.name != CONNECTION_FILE:
        path = path.parent / CONNECTION_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RpcnbError(errors.JOIN_NOT_FOUND.format(addr=where)) from None
    except (OSError, ValueError) as exc:
        raise RpcnbError(f"Cannot read the connection file {str(path)!r}: {exc}.") from None
    netns = data.get("netns", "")
    if data["address"].startswith("file://") and netns and netns != network_namespace():
        raise RpcnbError(OTHER_NETNS.format(addr=where, theirs=netns, mine=network_namespace()))
    return Connection(data["address"], token or data["secret"], data.get("leader", ""), path)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def sweep_groups() -> list[Path]:
    """Remove the directories (with their connection files, secrets included) of this
    user's groups whose first kernel is gone, since this machine booted; the ones
    removed."""
    import glob
    import shutil
    import tempfile

    from rpcnb.procs.processes import pid_alive

    removed = []
    for conn_file in glob.glob(os.path.join(tempfile.gettempdir(), "rpcnb-*", CONNECTION_FILE)):
        group_dir = Path(conn_file).parent
        try:
            if group_dir.stat().st_uid != os.getuid():
                continue
            data = json.loads(Path(conn_file).read_text())
            pid, boot = int(data["leader_pid"]), data.get("boot_id", "")
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours, or an older rpcnb's: left alone
        if boot == _boot_id() and not pid_alive(pid):
            shutil.rmtree(group_dir, ignore_errors=True)
            removed.append(group_dir)
    return removed


def network_namespace() -> str:
    """This process's network namespace (``net:[...]``)."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def check_host(host: str, allow_remote: bool) -> str:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(BAD_HOST.format(host=host, reason="use a numeric address")) from None
    if not ip.is_loopback and not allow_remote:
        raise ValueError(REMOTE_NEEDS_FLAG.format(host=host))
    return str(ip)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to exactly ``host:port`` (torch's own TCPStore would bind to every
    interface); its fd is handed to the store."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise RpcnbError(PORT_BUSY.format(port=port, host=host)) from None
        raise RpcnbError(BAD_HOST.format(host=host, reason=exc.strerror)) from None
    return sock


def serve_store(host: str, port: int, timeout: float) -> tuple[Any, int]:
    """The group's TCP store, served by this process on ``host:port`` only."""
    import torch.distributed as dist

    sock = listen(host, port)
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the fd now
    store = dist.TCPStore(host, bound, is_master=True, master_listen_fd=fd, use_libuv=False,
                          wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    return store, bound


def open_store(address: str, timeout: float = 5.0, prefixed: bool = True) -> Any:
    """The group's store as a client, under the prefix torch uses for the first init
    (``prefixed=False``: as it is, for ``init_rpc`` to add that prefix itself)."""
    import torch.distributed as dist

    if address.startswith("file://"):
        path = address[len("file://"):]
        if not os.path.exists(path):
            raise RpcnbError(errors.JOIN_NOT_FOUND.format(addr=address))
        store: Any = dist.FileStore(path, -1)
        store.set_timeout(datetime.timedelta(seconds=timeout))
    elif address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        try:
            store = dist.TCPStore(host.strip("[]"), int(port), is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout))
        except Exception:
            raise RpcnbError(errors.JOIN_NOT_FOUND.format(addr=address)) from None
    else:
        raise ValueError(f"Unsupported rendezvous address {address!r}: use a connection "
                         "file, file://PATH or tcp://HOST:PORT.")
    if not prefixed:
        return store
    from rpcnb.wire._torch import STORE_PREFIX

    return dist.PrefixStore(STORE_PREFIX, store)


# -- the store's keys ----------------------------------------------------------------------
# Every key rpcnb keeps in a group's store (under torch's prefix, ``_torch.STORE_PREFIX``),
# named here once; the modules that read and write them use these names.

LEADER_KEY = "rpcnb/leader"  # the leader's name: the group is open (announce_group)
PROTOCOL_KEY = "rpcnb/protocol"  # the leader's PROTOCOL
KEYCHECK_KEY = "rpcnb/keycheck"  # key_check(secret): a joiner has the secret, or not
NEXT_RANK_KEY = "rpcnb/next_rank"  # a counter: the next rank to try (roster.next_rank)
DEVICES_KEY = "rpcnb/devices"  # JSON: each member's devices and device map (roster.publish)
UNREACHABLE_KEY = "rpcnb/unreachable"  # JSON: unreachable members, since when (roster)
HOSTS_KEY = "rpcnb/hosts/n"  # a counter: the host entries announced to the fences
FENCES_KEY = "rpcnb/fences"  # a counter: the fences up (session.fence)


def name_key(name: str) -> str:
    """Taken by the first process that claims member name ``name``, for good."""
    return f"rpcnb/used/{name}"


def rank_key(rank: int) -> str:
    """Taken by the first process that claims ``rank``, for good."""
    return f"rpcnb/rank/{rank}"


def host_key(seq: int) -> str:
    """Host entry ``seq`` for the fences: an address and its MAC under the secret."""
    return f"rpcnb/hosts/{seq}"


def host_in_key(seq: int) -> str:
    """A counter: the fences that let host entry ``seq`` in."""
    return f"rpcnb/hosts/{seq}/in"


def collectives_prefix(generation: int) -> str:
    """The prefix of the keys of the ``generation``-th process group formed over the TCP
    store (``--collectives``): a store's keys cannot be taken back, so each has its own."""
    return f"rpcnb/collectives/{generation}"


def announce_group(store: Any, secret: str, leader: str) -> None:
    """On the leader: what a joiner checks before it joins torch's group (``check_group``),
    its name last, which says the group is open."""
    store.set(PROTOCOL_KEY, PROTOCOL)
    store.set(KEYCHECK_KEY, key_check(secret))
    store.set(LEADER_KEY, leader)


def check_group(store: Any, secret: str, addr: str) -> str:
    """Before joining: the group's leader, once the store shows a group that speaks this
    protocol and has this secret (RpcnbError otherwise). Nothing is claimed or joined
    yet, so a refusal leaves the group as it was."""
    try:
        leader = store.get(LEADER_KEY).decode()
    except Exception as exc:
        raise RpcnbError(errors.JOIN_NOT_FOUND.format(addr=addr)) from exc
    theirs = store.get(PROTOCOL_KEY).decode() if store.check([PROTOCOL_KEY]) \
        else "unknown (an older rpcnb)"
    if theirs != PROTOCOL:
        raise RpcnbError(OTHER_PROTOCOL.format(addr=addr, theirs=theirs, mine=PROTOCOL))
    if not verify(key_check(secret), store.get(KEYCHECK_KEY).decode()):
        raise RpcnbError(WRONG_SECRET.format(addr=addr))
    return leader
