"""rpcnb's opt-in UCX path for large tensors (``%rpc_init --ucx``, or ``RPCNB_UCX=1``).

With it, a tensor of at least ``threshold`` bytes that rpcnb's pickler meets (call
arguments and results, ``--push``, ``--fetch``, ``%%remote`` results, ``to_here()``) stays
in the sender's outbox under a 64-bit tag, and only the tag (with dtype, shape and device)
travels in the RPC message. The receiver, while it unpickles the message, posts a UCX
receive for that tag into a tensor of its own, then asks the sender over rpcnb's RPC
(``ucx_pull``, token-checked like every request) to send it; that request carries the
receiver's UCX worker address, so the sender opens its endpoint to the receiver lazily, the
first time, and keeps it. The receiver gets a new tensor: copy semantics, as on the other
paths. A CPU tensor is received into a buffer of this process's pool (pre-faulted huge
pages, taken back when the tensor is freed): the first write into a fresh tensor's pages
costs more than the transfer itself.

UCX picks the wire itself (shared memory and CMA on one host, TCP, InfiniBand/RoCE, CUDA
IPC, GPUDirect RDMA); telemetry records which one each endpoint uses, as ``ucx: tcp``.
Its TCP transport listens only where TensorPipe does (``lo`` on one host).
Endpoints between hosts use UCX's peer error handling (a dead peer fails the transfer);
on one host that mode would leave UCX only TCP, so rpcnb detects a dead peer itself
there. There is no progress thread: the two threads that wait for a transfer drive it.

Nothing imports ``ucxx`` unless the group asked for UCX. CUDA tensors are written to take
the same path (UCX reads ``__cuda_array_interface__``) but are untested here. UCX's worker,
endpoints, outbox and receive pool are a ``Link`` the session owns (``Session.paths.ucx``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import mmap
import os
import threading
import time
import weakref
from typing import Any

from rpcnb import errors, settings, telemetry, text, waiting
from rpcnb.paths import shm
from rpcnb.session import state
from rpcnb.wire import limits, options

ENV = options.UCX_ENV
DEFAULT_THRESHOLD = 1 << 20  # 1 MB
DEFAULT_POOL_BYTES = 1 << 30  # receive buffers kept for reuse, at most
PULL = "ucx_pull"
HUGE = 2 << 20  # a transparent huge page
MADV_POPULATE_WRITE = 23  # Linux 5.14; Python 3.11's mmap module does not name it

DEFAULT_TCP_THRESHOLD = 32 << 20  # where UCX over TCP overtakes TensorPipe (docs/ucx.md)
# transfers done, and (receiving, sending) those this process waits for now
STATS = ("sent", "sent_bytes", "received", "received_bytes", "failed", "receiving", "sending",
         "reused")


def requested(flag: bool | None = None) -> bool:
    """``flag`` when given, else whether ``RPCNB_UCX`` asks for the path."""
    return options.ucx_option(flag, check=False)


def option(flag: bool | None = None) -> bool:
    """The group's ``ucx`` option (``requested``), checked: RpcnbError with UCX_MISSING
    when it is on and ucxx is not installed, before anything starts."""
    return options.ucx_option(flag)


@functools.cache
def _ucxx() -> tuple[Any, Any]:
    """ucxx's ``libucxx`` and its ``Array``, loaded once per process (UCX_MISSING when
    ucxx is not installed, UCX_BROKEN when it does not load)."""
    options.ucx_option(True)  # UCX_MISSING when ucxx is not installed
    # ucxx asks UCX to stage rendezvous fragments in CUDA memory, which a machine without a
    # GPU does not have (TCP then runs at a quarter of its speed); UCX also warns about
    # variables it does not know, such as the one ucxx sets for CUDA.
    from rpcnb import machine

    if not machine.cuda_devices():
        settings.set_default("UCX_RNDV_FRAG_MEM_TYPE", "host")
    settings.set_default("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx._lib.libucxx as api
        from ucxx._lib.arr import Array
    except ImportError as exc:
        raise errors.RpcnbError(errors.UCX_BROKEN.format(
            reason=exc, extra=options.ucx_extra())) from exc
    return api, Array


def _config(s: Any) -> dict[str, str]:
    """UCX's settings for group ``s``: its TCP transport listens only where TensorPipe
    does (``lo`` on one host, the group's interface between hosts), never on every
    interface of the machine; and on one host a kernel lets its peers do the copies.
    ``UCX_NET_DEVICES`` and ``UCX_RNDV_SCHEME`` in the environment win."""
    from rpcnb import machine

    config = {}
    if s.one_host and s.kind == "kernel" and not machine.cuda_devices() and \
            not settings.is_set("UCX_RNDV_SCHEME"):
        # A kernel never copies from or into a peer's memory itself: as a receiver it asks
        # the sender to write (put), and a worker receiving from it reads (get, UCX's
        # choice). UCX has no peer error handling on one host, and a copy that fails
        # because the peer died mid-way aborts the process that made it: a worker then,
        # never the notebook's kernel. (Where there are GPUs UCX keeps its own choice:
        # not measured there yet.)
        config["RNDV_SCHEME"] = "put_zcopy"
    if settings.other("UCX_NET_DEVICES"):
        return config
    iface = settings.other("TP_SOCKET_IFNAME") if not s.one_host else ""
    return {**config, "NET_DEVICES": iface or "lo"}


class Link:
    """The UCX path of this process's group (``Session.paths.ucx``): UCX's context and
    worker, the endpoints to peers and the transport each moves data on, the outbox of
    tensors waiting to be pulled, the pool of receive buffers, the tags, the counts, and
    its ``RPCNB_UCX`` settings, read as the member starts. Made (ucxx loaded, its worker
    made) when a group that asked for UCX starts; ``close`` (the teardown, once torch's
    agent has left) leaves nothing of UCX in the process. One worker, driven from several
    threads: what changes, changes under ``lock``, one thread at a time."""

    def __init__(self, s: Any) -> None:
        api, _ = _ucxx()
        self.threshold: int = settings.number("RPCNB_UCX_THRESHOLD")  # bytes, from which
        # to a peer that UCX reaches over TCP (known after the first transfer), and in a
        # reply when every peer so far is over TCP: below it, TensorPipe's own TCP is faster
        self.tcp_threshold: int = settings.number("RPCNB_UCX_TCP_THRESHOLD")
        self.pool_limit: int = settings.number("RPCNB_UCX_POOL_BYTES")  # receive buffers
        self.idle: float = settings.number("RPCNB_UCX_IDLE_S")  # seconds, then unmapped
        self.lock = threading.RLock()
        self.ctx: Any = api.UCXContext(config_dict=_config(s), feature_flags=(api.Feature.TAG,))
        self.worker: Any = api.UCXWorker(self.ctx)
        self.address = bytes(self.worker.address)
        # tags are unique in the group: rank, then this process, then a counter
        self.tag_base = ((s.rank & 0xFFFF) << 48) | ((os.getpid() & 0xFFFF) << 32)
        self.tags = itertools.count(1)
        self.active = True  # until close
        self.eps: dict[str, Any] = {}  # peer name -> endpoint
        self.transports: dict[str, str] = {}  # peer name -> the UCX transport its endpoint uses
        self.outbox: dict[int, tuple[Any, float, str]] = {}  # tag -> (flat bytes, when, to whom or '')
        self.abandoned: list[tuple[Any, Any]] = []  # (request, buffer) UCX may still write into
        self.free: list[tuple[mmap.mmap, float]] = []  # receive buffers no tensor uses, since when
        self.pool_bytes = 0  # of every receive buffer the pool made, in use or free
        self.counts = dict.fromkeys(STATS, 0)

    def close(self) -> None:
        """Close every endpoint and the worker (nothing of UCX is left in this process)."""
        with self.lock:
            if not self.active and self.worker is None:
                return
            self.active = False
            for ep in self.eps.values():
                with contextlib.suppress(Exception):
                    ep.close_blocking(period=1000, max_attempts=100)
            self.eps.clear()
            self.transports.clear()
            self.outbox.clear()
            if self.worker is not None:
                with contextlib.suppress(Exception):
                    self.worker.cancel_inflight_requests(period=1000, max_attempts=100)
            self.abandoned.clear()
            self.worker = None
            self.ctx = None
            self._trim(float("inf"))  # buffers tensors still use are unmapped when those are freed

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return dict(self.counts, endpoints=len(self.eps), outbox=len(self.outbox),
                        transports=dict(self.transports), pool_bytes=self.pool_bytes,
                        pool_free=len(self.free))

    def wants(self, tensor: Any) -> bool:
        """Should this tensor take the UCX path?"""
        if not self.active or shm.THREAD.off:
            return False
        return (
            (tensor.is_cpu or tensor.is_cuda)
            and not tensor.requires_grad  # distributed autograd needs TensorPipe's tensor table
            and tensor.layout is shm.strided()
            and not tensor.is_quantized
            and tensor.element_size() * tensor.nelement()
            >= self.threshold_to(telemetry.current_peer())
        )

    def threshold_to(self, peer: str) -> int:
        """The size from which a tensor to ``peer`` ('' in a reply) takes UCX."""
        with self.lock:
            known = [self.transports[peer]] if peer in self.transports else (
                list(self.transports.values()) if not peer else [])
        if known and all(t == "tcp" for t in known):
            return max(self.threshold, self.tcp_threshold)
        return self.threshold

    def _sweep(self, s: Any, now: float) -> None:
        """Drop tensors nobody pulled within twice the group's RPC timeout (their message
        was lost), and at once those sent to a member that died since (under ``lock``)."""
        timeout = s.options.timeout * 2
        for tag, (_, when, peer) in list(self.outbox.items()):
            if now - when > timeout or (peer and s.is_dead(peer)):
                del self.outbox[tag]

    def export(self, tensor: Any, s: Any) -> tuple[Any, tuple[Any, ...]] | None:
        """Keep ``tensor`` in the outbox; the reduce tuple that pulls it on the receiver."""
        import torch

        flat = tensor.detach()
        if not flat.is_contiguous():
            flat = flat.contiguous()
        flat = flat.reshape(-1).view(torch.uint8)
        now = time.monotonic()
        with self.lock:
            self._sweep(s, now)
            tag = self.tag_base | (next(self.tags) & 0xFFFFFFFF)
            self.outbox[tag] = (flat, now, telemetry.current_peer())  # '' in a reply
        return _rebuild, (s.name, tag, str(tensor.dtype), tuple(tensor.shape),
                          str(tensor.device), flat.numel())

    def receive(self, s: Any, sender: str, tag: int, device: str, nbytes: int) -> Any:
        """On the receiver: ``nbytes`` filled over UCX from ``sender``'s outbox (a flat
        uint8 tensor on ``device``)."""
        import torch

        from rpcnb.session import protocol

        if device.startswith("cuda"):
            # untested (no GPU here): the sender's device index when this member has it
            index = torch.device(device).index or 0
            device = device if index < torch.cuda.device_count() else "cuda"
        if device == "cpu":
            out = self._host_buffer(nbytes)
        else:
            out = torch.empty(nbytes, dtype=torch.uint8, device=device)
        with self.lock:
            req = self.worker.tag_recv(_buffer(out), _ucxx()[0].UCXXTag(tag))
            self.counts["receiving"] += 1
        try:
            # answered once the bytes have gone over UCX: its limit grows with them
            fut = protocol.call_async(s.token, sender, PULL, tag, s.name, self.address,
                                      timeout=None, nbytes=nbytes)
            self._wait(s, req, out, sender, fut)
        finally:
            with self.lock:
                self.counts["receiving"] -= 1
        with self.lock:
            self.counts["received"] += 1
            self.counts["received_bytes"] += nbytes
        return out

    def _host_buffer(self, nbytes: int) -> Any:
        """A flat uint8 CPU tensor of ``nbytes`` to receive into, over a buffer of the pool.

        A fresh tensor's pages are faulted in by UCX's first write, one 4 kB page at a
        time, which costs more than the transfer itself (0.3 GB/s on the development VM).
        The pool keeps buffers of transparent huge pages, faulted in once, and takes each
        one back when the tensor over it (and every view of it) is freed; past
        ``pool_limit`` (``RPCNB_UCX_POOL_BYTES``) a receive gets a fresh tensor. Buffers
        idle for ``idle`` seconds (``RPCNB_UCX_IDLE_S``) are unmapped at the next receive,
        and all at shutdown.
        """
        import torch

        mm = None
        with self.lock:
            now = time.monotonic()
            self._trim(now - self.idle)
            fits = [b for b in self.free if nbytes <= len(b[0]) <= 2 * nbytes + HUGE]
            if fits:
                best = min(fits, key=lambda b: len(b[0]))
                self.free.remove(best)
                mm = best[0]
                self.counts["reused"] += 1
            else:
                size = -(-nbytes // HUGE) * HUGE
                if self.pool_bytes + size > self.pool_limit:
                    self._trim(now)  # make room from the idle ones, however recent
                if self.pool_bytes + size <= self.pool_limit:
                    mm = _new_buffer(size)
                    self.pool_bytes += size if mm is not None else 0
        if mm is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(mm)[:nbytes]
        # not at exit: a tensor still alive then still uses the buffer (closing it raised
        # BufferError), and the process's end unmaps it anyway
        weakref.finalize(view, self._give_back, mm).atexit = False
        out = torch.frombuffer(view, dtype=torch.uint8, count=nbytes)
        del view  # only the tensor's storage holds it now
        return out

    def _give_back(self, mm: mmap.mmap) -> None:
        """The last tensor over ``mm`` was freed: keep it for the next receive."""
        with self.lock:
            if self.active:
                self.free.append((mm, time.monotonic()))
                return
            self.pool_bytes -= len(mm)
        mm.close()

    def _trim(self, before: float) -> None:
        """Unmap the free buffers idle since before ``before`` (under ``lock``)."""
        for entry in [b for b in self.free if b[1] < before]:
            self.free.remove(entry)
            self.pool_bytes -= len(entry[0])
            entry[0].close()

    def pull(self, s: Any, tag: int, receiver: str, address: bytes) -> str:
        """On the sender (``ucx_pull``): send the tensor under ``tag`` to ``receiver``, and
        wait until it is there; returns the UCX transport it took."""
        with self.lock:
            entry = self.outbox.pop(tag, None)
            if entry is None or self.worker is None:
                raise RuntimeError(errors.UCX_GONE.format(peer=receiver))
            flat = entry[0]
            ep = self.eps.get(receiver)
            if ep is None:
                peer = _ucxx()[0].UCXAddress.create_from_buffer(address)
                # Between hosts UCX's error handling fails a transfer to a dead peer; on one
                # host it would rule out shared memory and CMA (rpcnb notices the death itself)
                ep = self.worker.create_endpoint_from_worker_address(peer, not s.one_host)
                self.eps[receiver] = ep
            start, t0 = telemetry.now(), time.perf_counter()
            req = ep.tag_send(_buffer(flat), _ucxx()[0].UCXXTag(tag))
            self.counts["sending"] += 1
        try:
            self._wait(s, req, flat, receiver, None)
        finally:
            with self.lock:
                self.counts["sending"] -= 1
        duration = time.perf_counter() - t0
        with self.lock:
            transport = self.transports.get(receiver) or _transport_of(ep)
            self.transports[receiver] = transport
            self.counts["sent"] += 1
            self.counts["sent_bytes"] += flat.numel()
        telemetry.record(receiver, "tensor", start, duration, flat.numel(),
                         channel=f"ucx: {transport}")
        return transport

    def _wait(self, s: Any, req: Any, buf: Any, peer: str, fut: Any) -> None:
        """Drive the worker until ``req`` (and the sender's answer ``fut``) completes; an
        error naming ``peer`` when it dies, fails, or the group ends first."""
        # the group's RPC timeout, and the tensor's bytes at the floor rate on top
        timeout = limits.grown(s.options.timeout, int(buf.nbytes))
        deadline = waiting.Deadline.after(timeout)
        idle = 0
        # not waiting.until: each look drives UCX's worker (there is no progress thread)
        while True:
            with self.lock:
                if self.worker is None:
                    reason = "this member left the group"
                    break
                progressed = self.worker.progress_once()
                done = req.completed
            if done:
                try:
                    req.check_error()
                except Exception as exc:
                    reason = f"UCX: {exc}"
                    break
                if fut is not None:
                    # the sender's answer: once it is here, its telemetry has the transfer
                    # (not waiting would save a message's latency, 1-2 ms)
                    try:
                        fut.wait()
                    except Exception as exc:
                        reason = _first_line(exc)
                        break
                return
            if s.is_dead(peer):
                reason = f"{peer} died ({s.how_gone(peer)})"
            elif fut is not None and fut.done():
                try:
                    fut.wait()
                    continue  # the sender is done; the last bytes are on their way
                except Exception as exc:
                    reason = _first_line(exc)
            elif deadline.passed():
                reason = (f"not received within {timeout:.0f} s (the group's RPC timeout, and "
                          f"its {text.size(int(buf.nbytes))} at {limits.MIN_RATE_ENV})")
            else:
                idle = 0 if progressed else idle + 1
                if idle > 64:  # nothing moving: let the other threads (and processes) run
                    deadline.nap(0.0005)
                continue
            break
        self._abandon(req, buf, peer, reason)

    def _abandon(self, req: Any, buf: Any, peer: str, reason: str) -> None:
        """A transfer to or from ``peer`` failed: its endpoint goes (RuntimeError)."""
        with self.lock:
            self.counts["failed"] += 1
            self.abandoned.append((req, buf))  # UCX may still write there until the worker closes
            ep = self.eps.pop(peer, None)
            self.transports.pop(peer, None)
        if ep is not None:
            with contextlib.suppress(Exception):
                ep.close()
        raise RuntimeError(errors.UCX_PEER_LOST.format(peer=peer, reason=reason))


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def link() -> Link | None:
    """The UCX path of this process's group (None: in no group, or one without UCX)."""
    s = state.active()
    paths = None if s is None else s.paths
    return None if paths is None else paths.ucx


def is_active() -> bool:
    found = link()
    return found is not None and found.active


def stats() -> dict[str, Any]:
    """The group's ``Link.stats()`` (all 0 outside a group with UCX)."""
    found = link()
    if found is None:
        return dict(dict.fromkeys(STATS, 0), endpoints=0, outbox=0, transports={},
                    pool_bytes=0, pool_free=0)
    return found.stats()


def transports() -> dict[str, str]:
    """Peer -> the UCX transport this process's endpoint to it moves data on."""
    found = link()
    if found is None:
        return {}
    with found.lock:
        return dict(found.transports)


def wants(tensor: Any) -> bool:
    """Should this tensor take the UCX path?"""
    found = link()
    return found is not None and found.wants(tensor)


def pull(s: Any, tag: int, receiver: str, address: bytes) -> str:
    """``Link.pull`` of group ``s`` (the ``ucx_pull`` request)."""
    found = None if s.paths is None else s.paths.ucx
    if found is None:
        raise RuntimeError(errors.UCX_GONE.format(peer=receiver))
    return found.pull(s, tag, receiver, address)


def _buffer(t: Any) -> Any:
    """What ucxx wraps: NumPy's view of a CPU tensor, a CUDA tensor as it is."""
    return _ucxx()[1](t.numpy() if t.device.type == "cpu" else t)


def _rebuild(sender: str, tag: int, dtype: str, shape: tuple[int, ...], device: str,
             nbytes: int) -> Any:
    """On the receiver: a new tensor, filled over UCX from the sender's outbox."""
    import torch

    s = state.active()
    found = None if s is None or s.paths is None else s.paths.ucx
    if s is None or found is None or not found.active:
        raise RuntimeError(errors.UCX_NOT_ON.format(sender=sender,
                                                    name=s.name if s else "outside any group"))
    out = found.receive(s, sender, tag, device, nbytes)
    torch_dtype = getattr(torch, dtype.replace("torch.", ""))
    return out.view(torch_dtype).view(shape)


def _new_buffer(size: int) -> mmap.mmap | None:
    try:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    with contextlib.suppress(OSError, AttributeError):
        mm.madvise(mmap.MADV_HUGEPAGE)  # 512 times fewer page faults where THP is on
    with contextlib.suppress(OSError):
        mm.madvise(MADV_POPULATE_WRITE)  # all of them now, in one go
    return mm


def _transport_of(ep: Any) -> str:
    """The transport of the endpoint's bulk-data lane, from ``ucp_ep_print_info``."""
    try:
        text = _ep_info(ep)
    except (OSError, AttributeError):
        return "?"
    lanes = [line for line in text.splitlines() if "lane[" in line]
    for kind in ("rma_bw", "am_bw", " am"):
        for line in lanes:
            if kind in line:
                # "#   lane[1]:  5:cma/memory.0 md[4] -> ... rma_bw#0"
                field = line.split("]:", 1)[1].split()[0]
                return field.split(":", 1)[-1].split("/", 1)[0]
    return "?"


def _ep_info(ep: Any) -> str:
    libucp = ctypes.CDLL("libucp.so.0")  # loaded already, by ucxx
    libc = ctypes.CDLL(None)
    libc.open_memstream.restype = ctypes.c_void_p
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        raise OSError("open_memstream failed")
    try:
        libucp.ucp_ep_print_info(ctypes.c_void_p(ep.handle), ctypes.c_void_p(stream))
    finally:
        libc.fclose(ctypes.c_void_p(stream))
    text = (buf.value or b"").decode(errors="replace")
    libc.free(buf)
    return text
