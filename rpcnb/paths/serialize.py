"""Ship notebook-defined code by value over torch RPC, and record every call.

torch's RPC pickler sends functions and classes by reference, so a function defined in a
notebook cell fails on the other side, or silently runs the callee's own function of the
same name. rpcnb swaps in a cloudpickle-based pickler: anything defined in ``__main__``
(notebook cells, remote cells) travels by value, while tensors and RRefs keep going
through torch's own tables so device maps and channels still apply. Which path each
tensor takes (by handle, rpcnb's shared memory, UCX, TensorPipe's table; DLPack arrays as
tensors) is ``rpcnb.paths.routes``.

While this process is in a group, every payload it sends is signed with the group's key
and every payload it receives is checked before it is unpickled (``rpcnb.session.rendezvous``).
``install()`` also hooks torch's rpc_sync / rpc_async / remote so every call this process
makes is recorded in ``rpcnb.telemetry`` (``rpcnb.paths.calls``). ``watch()`` (what ``%load_ext rpcnb`` calls)
installs both as soon as the user's code imports torch.
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import functools
import importlib.abc
import importlib.machinery
import io
import operator
import pickle
import sys
import threading
import types
from typing import Any

from rpcnb import errors
from rpcnb.paths import arrays, routes, shm, zerocopy
from rpcnb.session import rendezvous, state
from rpcnb.wire import notebook, patches

# Patch once torch's import has finished (it imports torch.distributed.rpc itself):
# patching in the middle of it would meet half-initialised modules.
_TARGET = "torch"


class _Kept(threading.local):
    """A thread's picklers for plain messages, (file, pickler), None while in use."""

    plain: tuple[io.BytesIO, Any] | None = None
    notebook: tuple[io.BytesIO, Any] | None = None


class Installed:
    """torch's RPC pickler as rpcnb runs it in this process: what ``install`` found in
    torch, and what the pickler keeps between messages. One per process, as torch's RPC
    pickler is (``INSTALLED``); ``uninstall`` gives torch its own back."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # install and uninstall, one at a time
        self.done = False  # install has patched torch (is_installed)
        self.tensor: Any = None  # torch.Tensor
        self.udf: Any = None  # torch's PythonUDF, a Python call's message
        self.tables: Any = None  # torch's thread-local RPC tensor tables
        self.rrefs: tuple[type, ...] = ()  # torch's RRef types
        self.plain_table: dict[Any, Any] = {}  # copyreg's, the RRefs' and tensors' reducers
        self.deserialize: Any = None  # torch's own _InternalRPCPickler.deserialize
        self.hooked: dict[Any, tuple[str, str]] = {}  # torch's functions the hooks replaced
        self.on_call: Any = None  # on_call's wrap
        self.entry: Any = None  # rpcnb.session.protocol.entry, found at the first request
        self.by_name: dict[int, Any] = {}  # id -> function found importable by name (kept)
        self.fields: dict[type, tuple[str, ...]] = {}  # rpcnb's message classes -> fields
        self.table: tuple[Any, dict[Any, Any]] | None = None  # (built from, cloudpickle's table)
        self.kept = _Kept()  # each thread's picklers of plain messages (_serialize_plain)


# the process's: torch has one RPC pickler per process, which install patches once
INSTALLED = Installed()


def _serialize(pickler: Any, obj: Any) -> tuple[bytes, list[Any]]:
    """torch's ``_InternalRPCPickler.serialize``, with cloudpickle's by-value reducers
    where a message needs them (``plain`` says where it does not)."""
    kind = _plainness(obj, 0)
    if kind == _NO_TENSORS:  # no reducer of the table can apply: the C pickler alone
        try:
            data = pickle.dumps(obj, PROTOCOL)
        except pickle.PicklingError:
            kind = _stale()
        else:
            s = state.active()
            return (data if s is None else rendezvous.sign(s.sign_key, s.name, data)), []
    # a message that fails to pickle is never sent: the shared-memory buffers its tensors
    # took (or that it marked in transit) are given back, here and before each retry
    undo = shm.THREAD.taken
    mark = len(undo)
    try:
        if kind != _NOT_PLAIN:
            try:
                return _serialize_plain(obj, kind & _NOTEBOOK)
            except _Unshipped:
                # another thread rebound a global of a notebook function in it just now
                shm.give_back(mark)
            except pickle.PicklingError:
                shm.give_back(mark)
                _stale()
        return _serialize_full(obj)
    except BaseException:
        shm.give_back(mark)
        raise
    finally:
        if len(undo) != mark:  # sent (or given back): nothing more to undo
            del undo[mark:]


def _serialize_full(obj: Any) -> tuple[bytes, list[Any]]:
    """cloudpickle's way: any message, functions and classes by value where they are not
    importable, with the dispatch table ``obj`` needs."""
    from rpcnb.wire import _torch

    f = io.BytesIO()
    p = _pickler_class()(f, _dispatch_table(obj))
    # a remote cell's result whose call said zero_copy=False (cells.runner.CellResult)
    copy = zerocopy.copying() if getattr(obj, "copy_tensors", False) else contextlib.nullcontext()
    with _torch.send_tables() as tensors, copy:
        try:
            p.dump(obj)
        except Exception as exc:
            # no local holds the error: a cycle through this frame would keep the message's
            # tensors until the cycle collector runs (errors.raise_from)
            errors.raise_from(_unsendable(p, obj, exc), exc)
    s = state.active()
    if s is None:
        return f.getvalue(), tensors
    return rendezvous.sign(s.sign_key, s.name, f.getvalue()), tensors


def _unsendable(p: Any, obj: Any, exc: Exception) -> BaseException:
    """The error to raise for ``obj`` that ``p`` could not pickle (``exc`` itself, or one
    that says what to do)."""
    err = notebook.explain(p, exc)
    if err is exc and type(obj).__name__ != "PythonUDF":  # a result, not a call
        return TypeError(errors.NOT_SENDABLE.format(type=_kind(obj), reason=exc))
    return err


def _stale() -> int:
    """A function found importable by name before is not any more (its module reloaded, its
    name rebound): forget the functions found, and take cloudpickle's path, which sends it
    by value as it would have the first time."""
    INSTALLED.by_name.clear()
    return _NOT_PLAIN


def _serialize_plain(obj: Any, notebook_code: int = 0) -> tuple[bytes, list[Any]]:
    """A message of functions importable by name, plain values, tensors and RRefs: the C
    pickler alone, with copyreg's table and rpcnb's tensor reducer (a plain message holds
    nothing else that a table entry would change), as fast as torch's. Notebook functions
    in it go as the bytes they were shipped as once (``notebook.shipped``)."""
    # this thread's pickler of the kind, taken while it is in use (a message pickled while
    # another is, on the same thread, gets a new one); made once: a pickler's making is a
    # fifth of a small message's pickling
    installed = INSTALLED
    kept = installed.kept
    slot = "notebook" if notebook_code else "plain"
    f, p = getattr(kept, slot) or _new_plain_pickler(notebook_code)
    setattr(kept, slot, None)
    tables = installed.tables
    # left as None, not deleted, between messages: getattr of a missing thread-local
    # attribute raises inside, about a microsecond (torch's own code reads None as absent)
    old = getattr(tables, "send_tables", None)
    tensors: list[Any] = []
    tables.send_tables = tensors
    try:
        p.dump(obj)
        data = f.getvalue()
    finally:
        tables.send_tables = old
        # the memo holds the message's objects: a new one lets them go now (clear_memo
        # keeps the table at its largest, and every later message would clear all of it)
        p.memo = {}
        f.seek(0)
        f.truncate()  # and the bytes (a BytesIO shrinks when truncated to far less)
        setattr(kept, slot, (f, p))
    s = state.active()
    if s is None:
        return data, tensors
    return rendezvous.sign(s.sign_key, s.name, data), tensors


def _new_plain_pickler(notebook_code: int) -> tuple[io.BytesIO, Any]:
    f = io.BytesIO()
    p = _NotebookCodePickler(f, protocol=PROTOCOL) if notebook_code \
        else pickle.Pickler(f, protocol=PROTOCOL)
    p.dispatch_table = INSTALLED.plain_table
    return f, p


class _Unshipped(Exception):
    """A notebook function lost its shipped bytes between ``plain`` and pickling."""


class _NotebookCodePickler(pickle.Pickler):
    """The C pickler, with notebook functions as their shipped bytes (the hook runs only
    for objects the C pickler has no fast path for: a plain message holds a handful)."""

    def reducer_override(self, obj: Any) -> Any:
        # every object without a fast path in the C pickler comes here: the test first
        if type(obj) is not types.FunctionType \
                or obj.__globals__ is not sys.modules["__main__"].__dict__:
            return NotImplemented
        blob = notebook.shipped_form(obj) or notebook.shipped(obj)  # checked by plain
        if not blob:  # never by name: the receiver would run its own __main__.f
            raise _Unshipped(obj.__qualname__)
        return notebook.load_shipped, (blob,)


_LEAVES = frozenset({int, float, bool, str, bytes, complex, type(None)})
_PLAIN_ITEMS = 64  # a longer container is checked by cloudpickle's path instead
_BY_VALUE = notebook.by_value_modules()  # cloudpickle's set, changed in place


# not plain; plain, pickled alone; plain, with the plain table (for tensors and RRefs);
# holding notebook functions that travel as their shipped bytes (a flag, with either)
_NOT_PLAIN, _NO_TENSORS, _NEEDS_TABLE, _NOTEBOOK = -1, 0, 1, 2
_FUNCTION_TYPE = types.FunctionType


def plain(obj: Any) -> bool:
    """Whether ``obj`` pickles the same with the C pickler alone as with cloudpickle: a
    call (``PythonUDF``) of a function importable by name, or a value, made of numbers,
    strings, bytes, None, dense CPU or CUDA tensors, RRefs, functions importable by name,
    and short tuples, lists and string-keyed dicts of those. Anything else (notebook code,
    lambdas, classes, objects of any other type) takes cloudpickle's path, which decides
    what goes by value."""
    return _plainness(obj, 0) != _NOT_PLAIN


def _plainness(obj: Any, depth: int) -> int:
    """``_NOT_PLAIN``, or whether a plain ``obj`` holds tensors or RRefs (only those need
    the dispatch table: without them the C pickler's own ``dumps`` gives the same bytes)."""
    cls = type(obj)
    if cls in _LEAVES:
        return _NO_TENSORS
    installed = INSTALLED
    if cls is installed.tensor:
        return _NEEDS_TABLE
    if depth > 3:
        return _NOT_PLAIN
    if cls is tuple or cls is list:
        return _all_plain(obj, depth) if len(obj) <= _PLAIN_ITEMS else _NOT_PLAIN
    if cls is dict:
        if not obj:
            return _NO_TENSORS
        if len(obj) > _PLAIN_ITEMS or any(type(k) is not str for k in obj):
            return _NOT_PLAIN
        return _all_plain(obj.values(), depth)
    if cls is installed.udf:
        func = obj.func
        # a function found importable before: _by_name's first test, without its frame
        by_name = installed.by_name
        kind = _NO_TENSORS if by_name.get(id(func)) is func and not _BY_VALUE \
            else _function(func)
        args = obj.args
        if kind == _NOT_PLAIN or (not args and not obj.kwargs):
            return kind  # a call without arguments: the common case
        if type(args) is tuple and len(args) <= _PLAIN_ITEMS and not obj.kwargs:
            # the next most common: a few numbers, strings, tensors, RRefs and functions
            # found importable before (the tutorials' _call_method(Cls.method, rref, ...)),
            # looked at here: a frame each costs a round trip about a microsecond, and
            # more with the caches cold after the wait for the last answer
            tensor, rrefs = installed.tensor, installed.rrefs
            for arg in args:
                k = type(arg)
                if k is tensor or k in rrefs:
                    kind |= _NEEDS_TABLE
                elif k is _FUNCTION_TYPE:
                    if by_name.get(id(arg)) is not arg or _BY_VALUE:  # _by_name's first test
                        break  # not found yet: the walk below asks _by_name
                elif k not in _LEAVES:
                    break
            else:
                return kind
        args = _plainness(args, depth + 1)
        if obj.kwargs and args != _NOT_PLAIN:
            more = _plainness(obj.kwargs, depth + 1)
            args = _NOT_PLAIN if more == _NOT_PLAIN else args | more
        return _NOT_PLAIN if args == _NOT_PLAIN else kind | args
    if cls is _FUNCTION_TYPE:
        # a function as an argument (the tutorials' _remote_method(Agent.select_action,
        # rref, ...)): by reference, as cloudpickle would send one importable by name
        return _function(obj)
    if cls in installed.rrefs:  # an RRef is forked by torch's reducer, in the plain table
        return _NEEDS_TABLE
    names = installed.fields.get(cls)
    if names is None:
        if not (cls.__module__.startswith("rpcnb.") and dataclasses.is_dataclass(cls)):
            return _NOT_PLAIN
        names = installed.fields[cls] = tuple(f.name for f in dataclasses.fields(cls))
    # rpcnb's own messages (a remote cell's result): by reference to their class, as
    # cloudpickle does; one that asks its tensors to be copied takes the full path
    if getattr(obj, "copy_tensors", False):
        return _NOT_PLAIN
    return _all_plain([getattr(obj, name) for name in names], depth)


def _all_plain(items: Any, depth: int) -> int:
    kind = _NO_TENSORS
    for item in items:
        k = _plainness(item, depth + 1)
        if k == _NOT_PLAIN:
            return _NOT_PLAIN
        kind |= k
    return kind


def _function(func: Any) -> int:
    """A function importable by name (``_NO_TENSORS``), a notebook function with shipped
    bytes (``_NOTEBOOK``), or one cloudpickle must send (``_NOT_PLAIN``)."""
    if _by_name(func):
        return _NO_TENSORS
    if notebook.is_notebook_function(func) and notebook.shipped(func):
        return _NOTEBOOK
    return _NOT_PLAIN


def _by_name(func: Any) -> bool:
    """A function the receiver imports by name: defined at the top of an importable module
    (not the notebook's, not one rpcnb's hooks replaced, not one the user registered with
    ``cloudpickle.register_pickle_by_value``), found there under its name."""
    by_value, found_before = _BY_VALUE, INSTALLED.by_name
    if found_before.get(id(func)) is func and not by_value:  # the common case
        return True
    if type(func) not in (types.FunctionType, types.BuiltinFunctionType) \
            or notebook.is_notebook_function(func) or func in notebook.REPLACED:
        return False
    name = getattr(func, "__module__", None) or "__main__"
    module = sys.modules.get(name)
    if module is None or module is sys.modules.get("__main__"):
        return False
    if by_value and any(name == m or name.startswith(m + ".") for m in by_value):
        return False
    found: Any = module
    for part in func.__qualname__.split("."):
        found = getattr(found, part, None)
    if found is not func:
        return False
    if len(found_before) > 10_000:
        found_before.clear()
    found_before[id(func)] = func
    return True


def _deserialize(pickler: Any, data: bytes, tensor_table: Any) -> Any:
    """torch's ``deserialize``, for payloads signed with the group's key only: nothing
    from outside the group is unpickled. A call of a plain Python function runs with its
    output captured for the member that sent it (``on_call``)."""
    installed = INSTALLED
    s = state.active()
    if s is None:
        return installed.deserialize(data, tensor_table)
    signed = rendezvous.unsign(s.sign_key, data)
    if signed is None:
        raise PermissionError(rendezvous.UNSIGNED)
    sender, payload = signed
    obj = _load(payload, tensor_table)
    wrap, udf = installed.on_call, installed.udf
    if wrap is not None and type(obj) is udf and obj.func is not (installed.entry or _entry()):
        # rpcnb's own requests (protocol.entry) route their output themselves
        run = wrap(obj.func, sender)
        if run is not obj.func:  # tuple's own __new__: the namedtuple's is one frame more
            obj = _tuple_new(udf, (run, obj.args, obj.kwargs))
    return obj


def _load(payload: Any, tensor_table: Any) -> Any:
    """torch's ``deserialize`` of a checked payload (a view), without its copy into a
    BytesIO; a name not found becomes the AttributeError torch's gives (returned, as
    torch does, for the caller to raise on the other side)."""
    tables = INSTALLED.tables
    old = getattr(tables, "recv_tables", None)  # None between messages, as send_tables
    tables.recv_tables = tensor_table
    try:
        return pickle.loads(payload)
    except AttributeError as exc:
        err = AttributeError(f"{exc} {NOT_FOUND}")
        err.__cause__ = exc
        return err
    finally:
        tables.recv_tables = old


# torch's words (torch/distributed/rpc/internal.py) for a function not found on the receiver
NOT_FOUND = ("Default RPC pickler does not serialize function code. Ensure that UDFs are "
             "defined on both caller and callee modules.")


def _entry() -> Any:
    """rpcnb.session.protocol.entry, looked up once (install may run while protocol is
    being imported, as torch's import completes)."""
    from rpcnb.session import protocol

    INSTALLED.entry = protocol.entry
    return INSTALLED.entry


_tuple_new = tuple.__new__


def on_call(wrap: Any) -> None:
    """``wrap(func, sender)`` -> the function to run instead, for every plain Python call
    another member makes here (rpcnb.cells.output captures its output with it)."""
    INSTALLED.on_call = wrap


def _dispatch_table(obj: Any) -> dict[Any, Any]:
    """One dict (the C pickler looks every object's type up in it): cloudpickle's
    reducers under torch's, with tensors to the RPC tensor table or rpcnb's shared memory,
    and DLPack arrays as tensors (``Table``). Built once, again only when torch's
    registered reducers change (or for a ScriptModule, which gets a reducer of its own)."""
    import cloudpickle
    import torch

    from rpcnb.wire import _torch

    key, built = _torch.reducers_key(), INSTALLED.table
    if built is not None and built[0] == key and not isinstance(obj, torch.jit.ScriptModule):
        return built[1]
    table = Table(cloudpickle.Pickler.dispatch_table)
    table.update(_torch.pickler_table(obj))
    # torch's reducers return classmethods, which cloudpickle would ship by value
    # (with the thread-local tensor tables in their globals); pickle them by name.
    table[types.MethodType] = _reduce_method
    table[torch.Tensor] = routes.reduce_tensor
    if not isinstance(obj, torch.jit.ScriptModule):
        INSTALLED.table = (key, table)
    return table


def _kind(obj: Any) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ in ("builtins", "__main__") \
        else f"{cls.__module__}.{cls.__qualname__}"


def _reduce_method(m: types.MethodType) -> tuple[Any, tuple[Any, str]]:
    return getattr, (m.__self__, m.__func__.__name__)


# What the C pickler does with an object whose type has no reducer in the table (and is
# no class): both rpcnb's picklers use this protocol.
PROTOCOL = pickle.HIGHEST_PROTOCOL
_default_reduce = operator.methodcaller("__reduce_ex__", PROTOCOL)
_MAX_TYPES = 20_000


class Table(dict):  # type: ignore[type-arg]
    """A pickler's dispatch table that looks at a type the first time an object of it
    misses the table: a DLPack array type (``rpcnb.paths.arrays``) gets the reducer that sends
    its arrays as tensors, any other type the C pickler's own default (``__reduce_ex__``),
    kept, so that the next object of that type costs one dict lookup as before. Objects
    of the types a message is mostly made of (tuples, dicts, lists, strings, numbers,
    functions) never reach the table, so small calls pay nothing for arrays."""

    def __missing__(self, cls: type) -> Any:
        lib = arrays.library(cls)
        if lib is not None:
            reducer: Any = functools.partial(routes.reduce_array, lib)
        elif issubclass(cls, type) or len(self) > _MAX_TYPES:
            raise KeyError(cls)  # a class whose metaclass is not type: pickled by name
        else:
            reducer = _default_reduce
        self[cls] = reducer
        return reducer


@functools.cache
def _extractor_base() -> Any:
    """The base of torch's tensor extractor: notebook's Pickler with a ``Table`` (which
    then finds a CuPy array's CUDA memory as a tensor instead of copying it to the
    host to look through it)."""
    import cloudpickle

    class ExtractorBase(notebook.Pickler):  # type: ignore[misc]
        dispatch_table = Table(cloudpickle.Pickler.dispatch_table)

    return ExtractorBase


@functools.cache
def _pickler_class() -> Any:
    class RpcPickler(notebook.Pickler):  # type: ignore[misc]
        def __init__(self, file: Any, table: Any) -> None:
            # The C pickler reads dispatch_table once, in __init__; cloudpickle's class
            # attribute would shadow a later assignment.
            self.dispatch_table = table
            super().__init__(file, protocol=PROTOCOL)

    return RpcPickler


def install() -> None:
    """Make torch's RPC pickler ship ``__main__`` code by value, and record every call
    (idempotent). Imports torch; ``watch()`` defers it until the user's code does."""
    loading = sys.modules.get("rpcnb.wire._torch")
    if loading is not None and not getattr(loading, "LOADED", False):
        return  # rpcnb.wire._torch is importing torch right now; start_member installs later
    installed = INSTALLED
    with installed.lock:
        if installed.done:
            return
        import torch

        from rpcnb.paths import calls
        from rpcnb.wire import _torch

        installed.tensor, installed.udf = torch.Tensor, _torch.python_udf()
        installed.tables = _torch.tensor_tables()
        rrefs = _torch.rref_reducers()
        installed.rrefs = tuple(rrefs)
        installed.plain_table = {**copyreg.dispatch_table, **rrefs,
                                 torch.Tensor: routes.reduce_tensor}
        installed.deserialize = _torch.rpc_pickler().deserialize
        _torch.patch_serialize(_serialize, _deserialize)
        # With devices set, torch finds the CUDA tensors in a Python result by pickling
        # it: with rpcnb's pickler too, or a result holding a notebook-defined class fails
        # (and a CuPy array would be copied to the host to be looked through)
        _torch.replace_tensor_extractor(_extractor_base())
        installed.hooked.update(_torch.hook_calls(calls.record_call))
        notebook.REPLACED.update(installed.hooked)
        installed.done = True


IN_A_GROUP = "uninstall() while this process is in a group: leave it first (rpcnb.shutdown())."


def uninstall() -> None:
    """Undo ``install`` exactly, for tests: torch's RPC pickler, tensor extractor and call
    entry points as they were (``rpcnb.wire.patches``), ``is_installed()`` False. A
    RuntimeError, with nothing changed, in a group or where another library patched since."""
    installed = INSTALLED
    with installed.lock:
        if not installed.done:
            return
        if state.active() is not None:
            raise RuntimeError(IN_A_GROUP)
        patches.restore()
        for func in installed.hooked:
            notebook.REPLACED.pop(func, None)
        installed.hooked.clear()
        installed.done = False


def is_installed() -> bool:
    return INSTALLED.done


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        install()


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the pickler right after torch is first imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            from importlib.util import find_spec

            spec = find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


def watch() -> None:
    """Install now if torch is already imported, else as soon as it is."""
    if _TARGET in sys.modules:
        install()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
