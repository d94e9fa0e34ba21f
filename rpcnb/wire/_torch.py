"""Every private torch name rpcnb uses, behind small functions, in one place.

torch.distributed.rpc is in maintenance mode: its public API is stable, but what rpcnb
needs beyond it (dynamic-group surgery, the RPC pickler, the tensor extractor, the agent)
is private. When torch is upgraded, this module is the one to read. Each name says the
torch versions it was checked against: 2.13.0 is what this project installs and tests;
2.11 is what the GPU machine of docs/benchmarks.md has (GPU.md).

Importing this module imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.rpc import api, internal
from torch.jit import _builtins

from rpcnb.waiting import until
from rpcnb.wire import limits, patches

# -- the agent and the store (torch 2.11, 2.13) ------------------------------------------

# torch prefixes the store of the n-th init_rpc in a process with "rpc_prefix_{n}"
# (torch/distributed/rpc/__init__.py); rpcnb resets the counter so every group is "0".
STORE_PREFIX = "rpc_prefix_0"
# Dynamic membership (torch/distributed/rpc/_utils.py, tensorpipe_agent.cpp): joins and
# leaves are serialised by this store key; the members are listed under the other one.
GROUP_TOKEN_KEY = "RpcGroupManagementToken"
WORKER_LIST_KEY = "names/_ALL_WORKER_INFOS"


def agent() -> Any:
    """The current TensorPipe agent (typed Any: its dynamic-group methods have no stubs)."""
    return api._get_current_rpc_agent()


def store() -> Any:
    """The store the current agent was built on (under torch's prefix)."""
    return agent().store


def member_names() -> list[str]:
    """The names torch's agent lists as members now, by rank."""
    return [w.name for w in sorted(agent().get_worker_infos(), key=lambda w: w.id)]


def device_maps() -> dict[str, dict[str, str]]:
    """This process's device maps as torch holds them, devices as strings."""
    maps = agent()._get_backend_options().device_maps
    return {peer: {str(a): str(b) for a, b in m.items()} for peer, m in maps.items()}


def cuda_routes() -> tuple[dict[str, dict[str, str]], set[str]]:
    """This process's device maps and its devices (what a reply may hold), as strings;
    empty when no agent is running (torch 2.11, 2.13)."""
    try:
        options = agent()._get_backend_options()
    except Exception:  # no agent: nothing to send CUDA tensors over
        return {}, set()
    maps = {peer: {str(a): str(b) for a, b in m.items()}
            for peer, m in options.device_maps.items()}
    return maps, {str(d) for d in options.devices}


def reset_init_counter() -> None:
    """Every rpcnb group has a fresh store, so the n-th init in a process must use the
    first prefix again (torch 2.11, 2.13: ``rpc._init_counter``)."""
    rpc._init_counter = 0  # type: ignore[attr-defined]


def init_rpc_with_store(name: str, rank: int, store: Any, options: Any) -> None:
    """``rpc.init_rpc`` for a dynamic group on a store we made (bound to one address):
    what init_rpc does after building its own store (torch 2.11, 2.13)."""
    import datetime

    import torch.distributed.autograd as dist_autograd
    from torch.distributed.rpc import backend_registry

    store.set_timeout(datetime.timedelta(seconds=options.rpc_timeout))
    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    rpc._init_counter = 1  # type: ignore[attr-defined]  # as init_rpc leaves it
    dist_autograd._init(rank)
    rpc._set_profiler_node_id(rank)  # type: ignore[attr-defined]
    rpc._init_rpc_backend(backend_registry.BackendType.TENSORPIPE,  # type: ignore[attr-defined]
                          prefixed, name, rank, None, options)


def reverse_maps_to_teach() -> list[tuple[str, Any, dict[Any, Any]]]:
    """What this member must tell every earlier one: ``(peer, this member's WorkerInfo,
    the reverse of this member's device map onto the peer)``.

    A member that replies with a CUDA tensor maps it back with the reverse of the
    caller's map. In a dynamic group torch computes those reverse maps for the joiner
    only, and hands the earlier members the joiner's own (keyed by their names: torch
    2.11-2.14, backend_registry._set_devices_and_reverse_device_map), so an earlier member
    could not reply to a later one with a CUDA tensor ("Response device mapping is not
    available for destination ..."), or to whichever of two workers started second."""
    me = agent().get_worker_info()
    maps = agent()._get_backend_options().device_maps
    return [(info.name, me, {theirs: mine for mine, theirs in maps[info.name].items()})
            for info in agent().get_worker_infos()
            if info.name != me.name and maps.get(info.name)]


def learn_reverse_map(joiner: Any, reverse: dict[Any, Any]) -> None:
    """On an earlier member: replies to ``joiner`` go back through ``reverse`` (its map
    onto this member, reversed), and this member's devices include those it sends from."""
    agent()._update_group_membership(joiner, sorted(set(reverse), key=str),
                                     {joiner.name: reverse}, True)


@dataclasses.dataclass
class FirstAgent:
    """What this process's first RPC agent fixed for every later one (torch 2.11, 2.13):
    the process's (``FIRST_AGENT``), for its life; None before its first agent."""

    # the TP_SOCKET_IFNAME it listened on: TensorPipe reads the variable once per process
    # (a function-static in TensorPipeAgent::guessAddress), so every later agent listens
    # on the address the first one found
    interface: str | None = None
    # its rank: distributed autograd keeps the first worker id a process had and refuses
    # any other one later, so the process keeps that rank in every later group
    # (``rpcnb.session.roster.fixed_rank``)
    rank: int | None = None


FIRST_AGENT = FirstAgent()


def check_interface(wanted: str) -> None:
    """RpcnbError when an earlier agent of this process fixed another interface than
    ``wanted`` (the TP_SOCKET_IFNAME the next agent would see)."""
    from rpcnb.errors import IFACE_FIXED, RpcnbError

    fixed = FIRST_AGENT.interface
    if fixed is not None and fixed != wanted:
        raise RpcnbError(IFACE_FIXED.format(fixed=fixed, wanted=wanted))


def note_interface(used: str) -> None:
    """An agent started with TP_SOCKET_IFNAME ``used``: the first one fixes it."""
    if FIRST_AGENT.interface is None:
        FIRST_AGENT.interface = used


def first_interface() -> str | None:
    """The TP_SOCKET_IFNAME this process's first agent listened on (None before one)."""
    return FIRST_AGENT.interface


def drop_locally(info: Any) -> None:
    """Tell this process's agent that ``info`` (a WorkerInfo) left the group."""
    agent()._update_group_membership(info, [], {}, False)


@dataclasses.dataclass(frozen=True)
class _TokenTry:
    """One try at the group token: whether it is ours now (the object's truth), and who
    held it before ('' when no one did)."""

    taken: bool
    holder: str

    def __bool__(self) -> bool:
        return self.taken


def _take_token(st: Any, mine: str, name: str, steal_any: bool) -> _TokenTry:
    """Try to take the group token as ``mine``: free, or held by ``name`` (it died holding
    it), or by anyone with ``steal_any``."""
    cur = st.compare_set(GROUP_TOKEN_KEY, "", mine).decode()
    if cur == mine:
        return _TokenTry(True, "")
    if (cur.startswith(f"Token_for_{name}_") or steal_any) \
            and st.compare_set(GROUP_TOKEN_KEY, cur, mine).decode() == mine:
        return _TokenTry(True, cur)
    return _TokenTry(False, cur)


def remove_member(name: str, tell: Callable[[str, Any], None], *, steal_any: bool = False,
                  wait: float = 10.0) -> bool:
    """Remove ``name`` from torch's dynamic group, as its graceful leave would have.

    Takes the group token (stealing it when ``name`` died holding it, mid-join, or from
    anyone with ``steal_any``), drops ``name`` from the store's member list and from this
    agent, calls ``tell(other, info)`` for every other member so it drops it too, then
    releases the token and wakes whoever waited on the dead one's token. False when
    ``name`` is not a member. (torch 2.11, 2.13: tensorpipe_agent.cpp's token protocol.)
    """
    from rpcnb.errors import RpcnbError

    ag = agent()
    st = ag.store
    try:
        info = ag.get_worker_info(name)
    except Exception:
        return False  # it never joined, or is already gone
    mine = f"Token_for_rpcnb_forget_{name}_{time.monotonic_ns()}"
    token = until(lambda: _take_token(st, mine, name, steal_any), wait, every=0.05)
    if not token:
        raise RpcnbError(f"the group token stays held by {token.holder!r}")
    stolen = token.holder
    try:
        entries = st.get(WORKER_LIST_KEY).decode().split(",")
        keep = [e for e in entries if e and e != f"{name}-{info.id}"]
        st.set(WORKER_LIST_KEY, "".join(e + "," for e in keep))
        me = ag.get_worker_info().name
        for w in ag.get_worker_infos():
            if w.name == name:
                continue
            if w.name == me:
                drop_locally(info)
            else:
                with contextlib.suppress(Exception):
                    tell(w.name, info)
    finally:
        st.set(GROUP_TOKEN_KEY, "")
        st.set(mine, "Done")
        if stolen:
            st.set(stolen, "Done")
    return True


# -- the RPC pickler (torch 2.11, 2.13: torch/distributed/rpc/internal.py) ---------------


def rpc_pickler() -> Any:
    """torch's ``_InternalRPCPickler`` instance, which every Python RPC goes through."""
    return internal._internal_rpc_pickler


def pickler_table(obj: Any) -> dict[Any, Any]:
    """The dispatch table torch's RPC pickler would use for ``obj``: copyreg's, tensors
    into the RPC tensor table, RRefs by fork, ScriptModules by torch.jit.save, and the
    reducers registered with ``_register_reducer``."""
    p = rpc_pickler()
    table = dict(p._dispatch_table)
    table.update(rref_reducers())
    if isinstance(obj, torch.jit.ScriptModule):
        table[obj.__class__] = p._script_module_reducer
    table.update(p._class_reducer_dict)
    return table


def rref_reducers() -> dict[type, Callable[[Any], Any]]:
    """torch's RPC pickler's reducers of RRefs (``PyRRef``, made by ``rpc.remote`` or
    received; ``RRef``, made by its constructor): a fork for the receiver."""
    p = rpc_pickler()
    return {dist.rpc.PyRRef: p._py_rref_reducer, dist.rpc.RRef: p._rref_reducer}


def reducers_key() -> tuple[int, int]:
    """Changes when torch's RPC pickler's reducers do (``_register_reducer``)."""
    p = rpc_pickler()
    return (len(p._dispatch_table), len(p._class_reducer_dict))


def tensor_receiver() -> Callable[[int], Any]:
    """What torch's own pickler names a tensor of a message by (its index in the message's
    tensor table): what a receiver running torch alone reads."""
    return internal._InternalRPCPickler._tensor_receiver  # type: ignore[no-any-return]


def python_udf() -> type:
    """The type of a Python call's message (``PythonUDF(func, args, kwargs)``)."""
    return internal.PythonUDF  # type: ignore[no-any-return]


def tensor_tables() -> Any:
    """torch's thread-local RPC tensor tables (``send_tables`` while a message is pickled)."""
    return internal._thread_local_tensor_tables


@contextlib.contextmanager
def send_tables() -> Iterator[list[Any]]:
    """The thread-local tensor table that a message's tensors go into while it is
    pickled (nested pickling keeps the outer table, as torch's own serialize does)."""
    tables = internal._thread_local_tensor_tables
    old = getattr(tables, "send_tables", None)
    tables.send_tables = []
    try:
        yield tables.send_tables
    finally:
        tables.send_tables = old  # None between messages (torch's code reads it as absent)


def patch_serialize(serialize: Callable[[Any, Any], tuple[bytes, list[Any]]],
                    deserialize: Callable[[Any, bytes, Any], Any]) -> None:
    """Make torch's RPC pickler call ``serialize(pickler, obj)`` for every Python message
    it sends and ``deserialize(pickler, data, tensor_table)`` for every one it receives
    (C++ calls both by attribute on the pickler instance). ``patches.restore`` undoes it."""
    p = rpc_pickler()
    patches.replace(p, "serialize", types.MethodType(serialize, p))
    patches.replace(p, "deserialize", types.MethodType(deserialize, p))


# -- the tensor extractor (torch 2.11, 2.13: torch/_jit_internal.py) ---------------------
#
# With devices set (a device map), torch's C++ future code finds the CUDA tensors in a
# Python result by pickling it with _jit_internal._TensorExtractor, a plain pickle.Pickler,
# looked up by _extract_tensors at every call (C++ caches _extract_tensors itself, so only
# the class can be replaced).


def replace_tensor_extractor(pickler_base: type) -> None:
    """Make ``_extract_tensors`` pickle with ``pickler_base`` (a pickle.Pickler subclass,
    cloudpickle's for rpcnb) instead of plain pickle, keeping torch's persistent_id rule."""
    from torch import _jit_internal as jit

    original = jit._TensorExtractor
    if getattr(original, "_rpcnb", False):
        return

    class TensorExtractor(pickler_base):  # type: ignore[misc, valid-type]
        _rpcnb = True

        def __init__(self, *args: Any, tensors: list[Any], **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.tensors = tensors

        persistent_id = original.persistent_id

    patches.replace(jit, "_TensorExtractor", TensorExtractor)


def extract_tensors(obj: Any) -> list[Any]:
    """What torch's C++ calls to find the tensors in a Python value."""
    from torch import _jit_internal as jit

    return list(jit._extract_tensors(obj))


# -- call hooks (torch 2.11, 2.13: torch/distributed/rpc/api.py) -------------------------

UNSET_RPC_TIMEOUT = api.UNSET_RPC_TIMEOUT
_SYNC = internal.RPCExecMode.SYNC


def hook_calls(on_call: Callable[[Any, Any, Any, Any, Callable[[], Any], bool], Any]
               ) -> dict[Any, tuple[str, str]]:
    """Call ``on_call(to, func, args, kwargs, send, sync)`` around every rpc_sync, rpc_async
    and remote this process makes: ``send()`` (a ``functools.partial``: no frame) makes the
    call and returns its future (or RRef), ``call_instead(send, func2, args2, kwargs2)``
    makes that call instead; ``sync`` says the caller is ``rpc_sync``, which waits on that
    future at once, on this thread (``fut = _invoke_rpc(...); return fut.wait()``).

    ``api._invoke_rpc`` (behind rpc_sync and rpc_async) and ``api.remote`` are replaced by
    wrappers that carry torch's own module and name (functools.wraps), so code that
    imported ``remote`` by name still pickles it by reference. Returns the functions
    replaced, with where they were (code that imported one before the hook holds the
    original: it must travel by that name too). Once: its caller (``serialize.install``)
    holds its install lock, and a second call finds the hooks in place."""
    if patches.replaced(api, "_invoke_rpc"):
        return {}
    original_invoke = api._invoke_rpc
    original_remote = api.remote
    partial = functools.partial

    def python_call(to: Any, func: Any, rpc_type: Any, args: Any, kwargs: Any,
                    rpc_timeout: float) -> Any:
        # torch's _invoke_rpc, for a plain Python function (the wrapper below sends
        # nothing else here), without its Python around the send (the profiler's
        # context, the checks for TorchScript): what its last branch does, the same C++
        # call. A builtin written in Python (torch.einsum), an async_execution function,
        # or a torch profiler on (it records RPCs there) go through torch's own.
        if hasattr(func, "_wrapped_async_rpc_function") or _profiler_enabled() \
                or not api._is_current_rpc_agent_set() \
                or _BUILTIN_OPS.get(id(func)) is not None:
            return original_invoke(to, func, rpc_type, args, kwargs, rpc_timeout)
        return _send_udf(to, func, args or (), kwargs or {}, rpc_timeout, False)

    @functools.wraps(original_invoke)
    def _invoke_rpc(to: Any, func: Any, rpc_type: Any, args: Any = None, kwargs: Any = None,
                    rpc_timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        if rpc_timeout == UNSET_RPC_TIMEOUT and (args or kwargs):
            rpc_timeout = payload_timeout(args, kwargs)
        # a builtin (torch.add) goes to torch's own at once: it has no Python to skip
        send = python_call if type(func) is _FUNCTION else original_invoke
        return on_call(to, func, args, kwargs,
                       partial(send, to, func, rpc_type, args, kwargs, rpc_timeout),
                       rpc_type is _SYNC)

    @functools.wraps(original_remote)
    def remote(to: Any, func: Any, args: Any = None, kwargs: Any = None,
               timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        if timeout == UNSET_RPC_TIMEOUT and (args or kwargs):
            timeout = payload_timeout(args, kwargs)
        return on_call(to, func, args, kwargs,
                       partial(original_remote, to, func, args, kwargs, timeout), False)

    patches.replace(api, "_invoke_rpc", _invoke_rpc)
    patches.replace(api, "remote", remote)
    patches.replace(rpc, "remote", remote)  # the package re-exports api's names
    return {original_invoke: (api.__name__, "_invoke_rpc"),
            original_remote: (api.__name__, "remote")}


_FUNCTION = types.FunctionType
_profiler_enabled = torch.autograd._profiler_enabled
# torch.jit's table of what RPC sends as builtin operators, by id: torch's own, made once
# per process (importing torch makes it) and added to in place (_register_builtin)
_BUILTIN_OPS: dict[int, Any] = _builtins._get_builtin_table()


def call_instead(send: Any, func: Any, args: Any, kwargs: Any) -> Any:
    """``send()`` (a hook's) for a call of ``func(*args, **kwargs)`` instead of its own: to
    the same member, of the same kind, with the same time limit."""
    original, (to, _func, *rest) = send.func, send.args
    if original is patches.original(api, "remote"):  # (to, func, args, kwargs, timeout)
        return original(to, func, args, kwargs, rest[-1])
    return original(to, func, rest[0], args, kwargs, rest[-1])  # (to, func, rpc_type, ...)


_TENSOR = torch.Tensor
_SEQUENCES = (list, tuple)
_BYTES = (bytes, bytearray)
_NO_BYTES = frozenset({int, float, str, bool, type(None), _FUNCTION, rpc.PyRRef, rpc.RRef})
_DENSE, _COO = torch.strided, torch.sparse_coo


def payload_timeout(args: Any, kwargs: Any) -> float:
    """The time limit of a call made without one (torch's UNSET: the group's RPC timeout)
    whose arguments carry tensors and bytes (one level into lists and tuples): the group's
    timeout grown by their size (``rpcnb.wire.limits``) from ``limits.GROW_FROM`` bytes,
    else still UNSET. It runs on every call: a few hundred nanoseconds."""
    nbytes = _bytes_in(args) if args else 0
    if kwargs:
        nbytes += _bytes_in(kwargs.values())
    if nbytes < limits.GROW_FROM:
        return UNSET_RPC_TIMEOUT
    return limits.grown(rpc.get_rpc_timeout(), nbytes)


def _bytes_in(items: Any, nested: bool = True) -> int:
    nbytes = 0
    for item in items:
        kind = type(item)  # not isinstance: torch.Tensor's metaclass makes it slow
        if kind is _TENSOR or (kind not in _NO_BYTES and kind not in _BYTES
                               and kind not in _SEQUENCES and issubclass(kind, _TENSOR)):
            nbytes += item.nbytes if item.layout is _DENSE else _sparse_bytes(item)
        elif kind in _BYTES:
            nbytes += len(item)
        elif kind in _SEQUENCES and nested:
            nbytes += _bytes_in(item, False)
    return nbytes


def _sparse_bytes(t: Any) -> int:
    """What a tensor without nbytes holds: a COO one its values and indices, a compressed
    one (CSR, BSR, ...) its values; any other (mkldnn) as many bytes as if it were dense."""
    if t.layout is _COO:
        return int(t._values().nbytes + t._indices().nbytes)
    try:
        return int(t.values().nbytes)
    except RuntimeError:
        return int(t.element_size() * t.numel())


def is_builtin(func: Any) -> bool:
    """Whether torch RPC sends a call of ``func`` as a builtin operator (``torch.add``):
    serialized in C++, its tensors in TensorPipe's table, never through the pickler."""
    return _BUILTIN_OPS.get(id(func)) is not None  # _find_builtin's work


def send_python_call(to: str, func: Any, args: tuple[Any, ...], timeout: float) -> Any:
    """``rpc.rpc_async(to, func, args=args, timeout=timeout)`` of a Python function
    (``async_execution`` ones too) as torch's ``_invoke_rpc`` sends it, without its Python
    around the send nor the call hooks above: the call's future. None when that Python has
    work to do (no agent; a torch profiler on): then ``rpc.rpc_async``. ``timeout`` in
    seconds, 0 for none. rpcnb's requests only (``protocol.send_async``; torch 2.11, 2.13)."""
    if not api._is_current_rpc_agent_set() or _profiler_enabled():
        return None
    return _send_udf(to, func, args, {}, timeout, hasattr(func, "_wrapped_async_rpc_function"))


def _send_udf(to: Any, func: Any, args: Any, kwargs: Any, timeout: float, is_async: bool) -> Any:
    """The last branch of torch's ``_invoke_rpc``, the destination first, as torch's: an
    unknown name fails before anything is pickled (or a pushed tensor handed over)."""
    info = api._to_worker_info(to)
    data, tensors = api._default_pickler.serialize(internal.PythonUDF(func, args, kwargs))
    return api._invoke_rpc_python_udf(info, data, tensors, timeout, is_async)


def rref_future(rref: Any) -> Any:
    """The future that completes when ``rref``'s remote creation has finished."""
    return rref._get_future()


# -- display (torch 2.11, 2.13) ----------------------------------------------------------
#
# rpcnb.frontend.rrefs names the type rpc.remote returns by string, so that %load_ext rpcnb
# imports no torch: "torch._C._distributed_rpc.PyRRef".


def tensor_preview(tensor: Any) -> str:
    """A short repr of ``tensor`` (torch's printoptions as a context manager)."""
    from torch._tensor_str import printoptions

    with printoptions(threshold=24, edgeitems=2, precision=4, linewidth=72):
        return repr(tensor.detach())


# The last line: rpcnb.paths.serialize's import hook (which fires when torch is first imported)
# must not use this module while it is still being imported (importing torch, say).
LOADED = True


# -- shared storages (torch 2.11, 2.13: torch/multiprocessing/reductions.py) --------------

# A CPU storage in shared memory is one of torch.multiprocessing's two kinds: the
# file-descriptor strategy's (a MapAllocator that keeps an fd of an unlinked /dev/shm
# file) or the file-system strategy's (a managed allocator over a named /dev/shm file,
# refcounted by torch_shm_manager). _get_shared_fd asks without changing anything; the
# _share_*_ methods would move a storage of another kind into new shared memory, so each
# is called only on a storage of its own kind.


def shared_storage_handle(tensor: Any) -> tuple[Any, ...] | None:
    """How another process on this host maps ``tensor``'s storage: ``("fd", fd, size)``,
    ``("file", manager, name, size)``, or None when it is not in torch's shared memory
    (or is a file mapped with ``torch.from_file``, which is not sent by handle)."""
    storage = tensor.untyped_storage()
    if storage.device.type != "cpu" or not storage.is_shared():
        return None
    try:
        fd = storage._get_shared_fd()
    except RuntimeError:  # not a MapAllocator: the file-system strategy's managed storage
        if storage._get_filename() is not None:
            return None
        manager, name, size = storage._share_filename_cpu_()
        return ("file", manager, name, int(size))
    if fd < 0:  # torch.from_file(shared=True): a file of the user's, not shared memory
        return None
    return ("fd", int(fd), int(storage.nbytes()))


def storage_from_fd(fd: int, size: int) -> Any:
    """A storage over the shared memory behind ``fd`` (dup'ed; the caller closes ``fd``);
    itself shared, so it can be sent on by handle."""
    return torch.UntypedStorage._new_shared_fd_cpu(fd, size)  # type: ignore[attr-defined]


def storage_from_name(manager: bytes, name: bytes, size: int) -> Any:
    """A storage over the file-system strategy's shared memory ``name``."""
    return torch.UntypedStorage._new_shared_filename_cpu(manager, name, size)
