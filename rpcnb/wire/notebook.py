"""Notebook code behaves like a module that each process imported once.

A function defined in a notebook cell (or a remote cell) lives in ``__main__``, which no
other process can import, so rpcnb ships it by value. Where it arrives, it is rebuilt with
that process's own notebook namespace as its globals (``sys.modules["__main__"]``: the
kernel's user namespace, a worker's remote-cell namespace), so every function shipped to
one process, whoever sent it, and the remote cells run there, share one set of globals,
kept between calls.

The globals a function uses travel with it, each tagged with where it was last assigned
and how often (``(origin, version)``), and a process takes a value only when it has not
had that assignment yet: **the notebook's latest assignment wins; a process's own changes
persist until then** (a name it no longer has, after a ``%reset`` there, is taken
again). Locks, conditions, events, semaphores, barriers, queues and thread-locals make
sense in one process only: they arrive as fresh ones, once per assignment. What makes
shipping cheap is cached per code object (the submodules a function reaches, which
cloudpickle finds by scanning ``sys.modules``), and a process keeps the functions it
rebuilt, so a function shipped again is the same object there.
A function whose globals cannot change in place is pickled once, into bytes that messages
carry until one of those globals is rebound (``shipped``, ``load_shipped``).
"""

from __future__ import annotations

import importlib
import io
import marshal
import os
import pickle
import queue
import socket
import sys
import threading
import types
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
from cloudpickle import cloudpickle as _cp

# Where values are assigned: this process, for good (a later process never reuses it).
PROCESS = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

UNPICKLABLE_GLOBAL = (
    "{func} uses the notebook global {name!r} (a {kind}), which cannot be sent to another "
    "process: {reason}. Create it inside the function, or pass what it holds as an argument."
)

Key = tuple[str, int]  # a notebook function's name everywhere: (PROCESS where defined, id there)
Tag = tuple[str, int]  # an assignment of a notebook global: (PROCESS that made it, its count there)


@dataclass(slots=True)
class Ledger:
    """What this process knows of the notebook code it shipped and took: one per process
    (``LEDGER``), kept for the process's life, across its groups (a function shipped to a
    kernel in one group is the same object there in the next; an assignment taken once is
    not taken again). The pickler of every message that carries notebook code reads it,
    so the tables are read without the lock; ``lock`` is held to change them together."""

    # held to change the tables below (reentrant: making a function's bytes pickles it,
    # and pickling it tags its globals)
    lock: threading.RLock = field(default_factory=threading.RLock)

    # -- the notebook's globals: which assignment a value is (the module's rule)
    # name -> (the object this process assigned to it, how many assignments so far)
    own: dict[str, tuple[Any, int]] = field(default_factory=dict)
    # name -> (the assignment taken from another process, the object it put here)
    received: dict[str, tuple[Tag, Any]] = field(default_factory=dict)
    # (origin, name) -> the latest of that origin's assignments taken here
    seen: dict[tuple[str, str], int] = field(default_factory=dict)

    # -- notebook functions: one object per function in each process
    # a function defined or rebuilt here -> its key
    keys: weakref.WeakKeyDictionary[Any, Key] = field(default_factory=weakref.WeakKeyDictionary)
    # key -> the function defined here (the entry goes as the function is freed)
    home: dict[Key, weakref.ref[Any]] = field(default_factory=dict)
    # key -> the function rebuilt here from what another process sent
    rebuilt: dict[Key, Any] = field(default_factory=dict)

    # -- what makes shipping cheap, kept (bounded where what arrives could grow it)
    # code object -> the imported submodules its function reaches (``_submodules_of``)
    submodules: weakref.WeakKeyDictionary[Any, list[str]] = field(
        default_factory=weakref.WeakKeyDictionary)
    # id(code object) -> (the code object, its marshal): marshalled once (``_CodeRef``)
    marshalled: dict[int, tuple[Any, bytes]] = field(default_factory=dict)
    # a code object's marshal -> that code object here: loaded once (``_load_code``)
    loaded: dict[bytes, Any] = field(default_factory=dict)
    # id -> a class or function cloudpickle found it can send by reference (kept alive,
    # so that the id stays its own; ``Pickler.reducer_override``)
    by_reference: dict[int, Any] = field(default_factory=dict)

    # -- notebook functions shipped once, as bytes (``shipped``, ``load_shipped``)
    # function -> what its bytes were made from, with the bytes
    forms: weakref.WeakKeyDictionary[Any, _Form] = field(
        default_factory=weakref.WeakKeyDictionary)
    # bytes read here -> the function made from them
    from_blob: dict[bytes, Any] = field(default_factory=dict)
    # the functions whose bytes are being made (under ``lock``: by one thread at a time),
    # innermost last, each with the notebook functions its bytes will hold
    building: list[tuple[Any, list[tuple[Any, _Form | None]]]] = field(default_factory=list)


LEDGER = Ledger()


def namespace() -> dict[str, Any]:
    """This process's notebook namespace: what ``__main__`` is here."""
    return sys.modules["__main__"].__dict__


def by_value_modules() -> set[str]:
    """The modules the user asked cloudpickle to ship by value
    (``cloudpickle.register_pickle_by_value``): their functions never go by name."""
    return _BY_VALUE  # type: ignore[no-any-return]


_BY_VALUE = _cp._PICKLE_BY_VALUE_MODULES  # changed in place by register_pickle_by_value


def is_notebook_function(obj: Any) -> bool:
    """A function defined in this process's notebook (or rebuilt into it)."""
    return type(obj) is types.FunctionType and obj.__globals__ is namespace()


# --------------------------------------------------------------------------- sending


def _tag_now(name: str, value: Any) -> Tag | None:
    """``_tag(name, value)`` without making one: None where it would be a new assignment."""
    got = LEDGER.received.get(name)
    if got is not None and got[1] is value:
        return got[0]
    own = LEDGER.own.get(name)
    return (PROCESS, own[1]) if own is not None and own[0] is value else None


def _tag(name: str, value: Any) -> Tag:
    """Where ``value`` (the global ``name`` here now) was assigned, and which time."""
    with LEDGER.lock:
        tag = _tag_now(name, value)  # forwarding what we took from elsewhere, or our own
        if tag is not None:
            return tag
        own = LEDGER.own.get(name)
        version = own[1] + 1 if own is not None else 1
        LEDGER.own[name] = (value, version)
        return (PROCESS, version)


class Fresh:
    """Stands for a process-local object (a lock, say): the receiver makes its own."""

    def __init__(self, kind: str, arg: Any = None) -> None:
        self.kind = kind
        self.arg = arg

    def make(self) -> Any:
        if self.kind == "local":
            return self.arg()
        return _FRESH[self.kind][1](self.arg)


_FRESH: dict[str, tuple[Any, Any]] = {
    "Lock": (type(threading.Lock()), lambda _: threading.Lock()),
    "RLock": (type(threading.RLock()), lambda _: threading.RLock()),
    "Condition": (threading.Condition, lambda _: threading.Condition()),
    "Event": (threading.Event, lambda _: threading.Event()),
    "BoundedSemaphore": (threading.BoundedSemaphore, lambda n: threading.BoundedSemaphore(n)),
    "Semaphore": (threading.Semaphore, lambda n: threading.Semaphore(n)),
    "Barrier": (threading.Barrier, lambda n: threading.Barrier(n)),
    "PriorityQueue": (queue.PriorityQueue, lambda n: queue.PriorityQueue(n)),
    "LifoQueue": (queue.LifoQueue, lambda n: queue.LifoQueue(n)),
    "Queue": (queue.Queue, lambda n: queue.Queue(n)),
    "SimpleQueue": (queue.SimpleQueue, lambda _: queue.SimpleQueue()),
}


def process_local(value: Any) -> Fresh | None:
    """A ``Fresh`` for a value that makes sense in one process only, else None."""
    if isinstance(value, threading.local):
        return Fresh("local", type(value))
    for kind, (cls, _make) in _FRESH.items():  # subclasses first: BoundedSemaphore...
        if isinstance(value, cls):
            arg = None
            if kind in ("Semaphore", "BoundedSemaphore"):
                arg = getattr(value, "_initial_value", getattr(value, "_value", 1))
            elif kind == "Barrier":
                arg = value.parties
            elif kind in ("Queue", "LifoQueue", "PriorityQueue"):
                arg = value.maxsize
            return Fresh(kind, arg)
    return None


def _forget_home(key: Key) -> Any:
    home = LEDGER.home  # not looked up when called: at exit the module's names are gone
    return lambda _ref: home.pop(key, None)


class _CodeRef:
    """A code object on its way: marshalled once per code object here, and turned back
    into a code object once per distinct marshal there (both sides keep them)."""

    __slots__ = ("code",)

    def __init__(self, code: Any) -> None:
        self.code = code

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        marshalled = LEDGER.marshalled
        data = marshalled.get(id(self.code))
        if data is None or data[0] is not self.code:
            data = (self.code, marshal.dumps(self.code))
            if len(marshalled) > 10_000:
                marshalled.clear()
            marshalled[id(self.code)] = data
            LEDGER.loaded[data[1]] = self.code  # coming back here, it is this very code object
        return (_load_code, (data[1],))


def _load_code(data: bytes) -> Any:
    loaded = LEDGER.loaded
    code = loaded.get(data)
    if code is None:
        code = marshal.loads(data)
        if len(loaded) > 10_000:
            loaded.clear()
        loaded[data] = code
    return code


def _function_key(func: Any) -> Key:
    key = LEDGER.keys.get(func)
    if key is None:
        key = (PROCESS, id(func))
        with LEDGER.lock:
            LEDGER.keys[func] = key
            LEDGER.home[key] = weakref.ref(func, _forget_home(key))
    return key


def _submodules_of(func: Any, values: list[Any]) -> list[str]:
    """Imported submodules ``func`` reaches through a package (``torch.nn`` through
    ``torch``): cloudpickle scans sys.modules for them, about a millisecond; once per
    code object here."""
    code = func.__code__
    found = LEDGER.submodules.get(code)
    if found is None:
        found = [m.__name__ for m in _cp._find_imported_submodules(code, values)]
        LEDGER.submodules[code] = found
    return found


def reduce_function(pickler: Any, func: Any) -> tuple[Any, ...]:
    """How a notebook function travels: its code, and its globals with their tags."""
    code = func.__code__
    g = func.__globals__
    items: dict[str, tuple[Any, Any]] = {}
    modules = []
    for name in _cp._extract_code_globals(code):
        if name not in g:
            continue  # a builtin, or a global the receiver defines itself
        value = g[name]
        if isinstance(value, types.ModuleType):
            modules.append(value)
            items[name] = (None, value)  # by reference: set where missing
            continue
        fresh = process_local(value)
        items[name] = (_tag(name, value), fresh if fresh is not None else value)
    closure = None
    closure_values: tuple[Any, ...] = ()
    if func.__closure__ is not None:
        closure = tuple(_cp._make_empty_cell() for _ in func.__closure__)
        closure_values = tuple(_cp._get_cell_contents(c) for c in func.__closure__)
    pickler.rpcnb_globals.append((func, items))
    state = {
        "attrs": dict(func.__dict__),
        "slots": {"__qualname__": func.__qualname__, "__annotations__": func.__annotations__,
                  "__kwdefaults__": func.__kwdefaults__, "__defaults__": func.__defaults__,
                  "__module__": func.__module__, "__doc__": func.__doc__},
        "closure": closure_values,
        "globals": items,
        "submodules": _submodules_of(func, modules + list(closure_values)),
    }
    return (_make_function, (_function_key(func), _CodeRef(code), func.__name__, closure),
            state, None, None, _set_function_state)


# Functions rpcnb replaced in a library (torch's rpc.remote, hooked for telemetry), with
# the module and name they are found under: code that imported one before it was replaced
# holds the original, which must still travel by that name, not by value. The process's,
# filled and emptied by ``rpcnb.paths.serialize.install`` and ``uninstall``.
REPLACED: dict[Any, tuple[str, str]] = {}


def _attribute(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


class Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, with notebook functions shipped as described in the module."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rpcnb_globals: list[tuple[Any, dict[str, Any]]] = []  # for ``explain``

    def reducer_override(self, obj: Any) -> Any:
        # cloudpickle decides for every class and function whether it can go by reference
        # (module and name lookups, tens of microseconds a message); the answer is kept
        by_reference = LEDGER.by_reference
        known = by_reference.get(id(obj))
        if known is obj:
            return NotImplemented
        reduced = super().reducer_override(obj)
        if reduced is NotImplemented and (type(obj) is types.FunctionType
                                          or isinstance(obj, type)):
            if len(by_reference) > 100_000:
                by_reference.clear()
            by_reference[id(obj)] = obj
        return reduced

    def _function_reduce(self, obj: Any) -> Any:
        if is_notebook_function(obj):
            return reduce_function(self, obj)
        where = REPLACED.get(obj)
        if where is not None:
            return (_attribute, where)
        return super()._function_reduce(obj)


# --------------------------------------------------------------------------- shipped once
#
# A notebook function whose globals are all steady (numbers, strings, modules, importable
# classes and functions, other such notebook functions) pickles to the same bytes until
# one of them is rebound. Those bytes are made once and kept (``shipped``); a message
# carries them as one value, so it takes the C pickler alone instead of cloudpickle's
# per-object hook, and a receiver that has read those bytes before takes the function it
# made from them (``load_shipped``). A global that is rebound, deleted or defined changes
# what the function's bytes are made from, and they are made again (with its new tag).
# Anything else (a list, a dict, a tensor, a notebook class, a lock, closures, attributes
# set on the function) can change in place, so those functions are pickled afresh with
# every message, as before.

_MISSING, _SELF = object(), object()  # a global not defined; the function itself
_STEADY_LEAVES = frozenset({int, float, bool, str, bytes, complex, type(None)})


class _Form:
    """What a function's shipped bytes were made from (``blob`` None: they cannot be):
    its code and attributes, each global's value and tag, and the forms of the notebook
    functions the bytes hold (``inner``)."""

    __slots__ = ("code", "names", "values", "tags", "defaults", "kwdefaults", "kwdefaults_copy",
                 "annotations", "annotations_copy", "attrs", "by_value", "inner", "blob")

    def __init__(self, func: Any, names: tuple[str, ...]) -> None:
        g = func.__globals__
        self.code = func.__code__
        self.names = names
        self.values = tuple(_SELF if g.get(n, _MISSING) is func else g.get(n, _MISSING)
                            for n in names)  # not the function itself: it would never be freed
        self.tags: tuple[Any, ...] = ()
        self.defaults = func.__defaults__
        self.kwdefaults, self.kwdefaults_copy = func.__kwdefaults__, dict(func.__kwdefaults__ or {})
        self.annotations = func.__annotations__
        self.annotations_copy = dict(self.annotations)
        self.attrs = (func.__qualname__, func.__name__, func.__module__, func.__doc__)
        self.by_value = frozenset(by_value_modules())
        self.inner: list[tuple[Any, _Form | None]] = []
        self.blob: bytes | None = None


def _same_items(now: dict[str, Any] | None, then: dict[str, Any]) -> bool:
    if now is None:
        return not then
    return len(now) == len(then) and all(now.get(k, _MISSING) is v for k, v in then.items())


def _current(func: Any, form: _Form) -> bool:
    """Whether ``func`` would still pickle to the bytes ``form`` was made for (what each
    message pays for a notebook function in it: identity checks and dict lookups)."""
    if func.__code__ is not form.code or func.__defaults__ is not form.defaults \
            or func.__closure__ is not None or func.__dict__ \
            or func.__kwdefaults__ is not form.kwdefaults \
            or func.__annotations__ is not form.annotations:
        return False
    if (form.kwdefaults is not None or form.kwdefaults_copy) \
            and not _same_items(func.__kwdefaults__, form.kwdefaults_copy):
        return False
    if (form.annotations or form.annotations_copy) \
            and not _same_items(func.__annotations__, form.annotations_copy):
        return False
    qualname, name, module, doc = form.attrs
    if func.__qualname__ is not qualname or func.__name__ is not name \
            or func.__module__ is not module or func.__doc__ is not doc:
        return False
    if (_BY_VALUE or form.by_value) and _BY_VALUE != form.by_value:
        return False
    g = func.__globals__
    for name, value, tag in zip(form.names, form.values, form.tags, strict=True):
        now = g.get(name, _MISSING)
        if now is not (func if value is _SELF else value):
            return False
        # the same object may be a later assignment (MODE = 1; MODE = 2; MODE = 1)
        if tag is not None and _tag_now(name, now) != tag:
            return False
    # the notebook functions inside the bytes (helpers, defaults): the same forms, current
    for inner, inner_form in form.inner:
        if inner_form is None or LEDGER.forms.get(inner) is not inner_form \
                or not _current(inner, inner_form):
            return False
    return True


def shipped_form(func: Any) -> bytes | None:
    """The bytes ``shipped`` last found current for ``func``, unchecked (for the pickler,
    right after ``shipped`` checked them for the same message)."""
    form = LEDGER.forms.get(func)
    return form.blob if form is not None else None


def _steady(value: Any, depth: int = 0) -> bool:
    """A value that cannot change without being rebound, and pickles without tables."""
    cls = type(value)
    if cls in _STEADY_LEAVES or cls is types.ModuleType:
        return True
    if cls is tuple:
        return depth < 3 and len(value) <= 16 and all(_steady(v, depth + 1) for v in value)
    if cls is types.FunctionType:
        if not is_notebook_function(value):
            return bool(_cp._should_pickle_by_reference(value))
        building = LEDGER.building
        top, inner = building[-1]
        if value is top:
            return True  # recursion: its own bytes
        if any(value is f for f, _ in building):
            return False  # functions calling each other: pickled afresh each time
        if shipped(value) is None:
            return False
        inner.append((value, LEDGER.forms.get(value)))
        return True
    if cls is types.BuiltinFunctionType:
        return isinstance(getattr(value, "__self__", None), (types.ModuleType, type(None)))
    if isinstance(value, type):
        return bool(_cp._should_pickle_by_reference(value))
    return cls.__module__ == "torch" and cls.__name__ in ("device", "dtype")


def shipped(func: Any) -> bytes | None:
    """The bytes a notebook function travels as while its globals stay as they are, made
    once; None for a function that must be pickled afresh with every message."""
    form = LEDGER.forms.get(func)
    if form is not None and _current(func, form):
        return form.blob
    with LEDGER.lock:
        form = _Form(func, tuple(_cp._extract_code_globals(func.__code__)))
        LEDGER.building.append((func, form.inner))
        try:
            if func.__closure__ is None and not func.__dict__ \
                    and all(v is _MISSING or v is _SELF or _steady(v) for v in form.values) \
                    and all(_steady(v) for v in func.__defaults__ or ()) \
                    and all(_steady(v) for v in form.kwdefaults_copy.values()) \
                    and all(_steady(v) for v in form.annotations_copy.values()):
                out = io.BytesIO()
                try:
                    Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(func)
                    form.blob = out.getvalue()
                except (pickle.PicklingError, TypeError, AttributeError, ValueError):
                    pass  # pickled afresh with each message: that path says what fails
        finally:
            LEDGER.building.pop()
        g = func.__globals__  # the tags the bytes hold (modules travel untagged)
        form.tags = tuple(None if v is _MISSING or type(v) is types.ModuleType
                          else _tag_now(n, g.get(n)) for n, v in zip(form.names, form.values, strict=True))
        LEDGER.forms[func] = form
        return form.blob


def _globals_here(func: Any) -> bool:
    """Whether every global name ``func``'s code uses is still in its namespace (or a
    builtin): a ``%reset`` there empties it, and the bytes carry what it needs again."""
    g = func.__globals__
    b = g.get("__builtins__", __builtins__)
    builtin = b if isinstance(b, dict) else vars(b)
    return all(n in g or n in builtin for n in _cp._extract_code_globals(func.__code__))


def load_shipped(blob: bytes) -> Any:
    """The function ``shipped`` bytes stand for: made once here from the same bytes."""
    from_blob = LEDGER.from_blob
    func = from_blob.get(blob)
    if func is None or func.__globals__ is not namespace() or not _globals_here(func):
        func = pickle.loads(blob)
        with LEDGER.lock:
            if len(from_blob) > 1000:
                from_blob.clear()
            from_blob[blob] = func
    return func


def explain(pickler: Any, error: BaseException) -> BaseException:
    """After ``error`` while pickling: which notebook global could not be sent, by which
    function, if that is what failed (else ``error`` itself)."""
    for func, items in getattr(pickler, "rpcnb_globals", []):
        for name, (_, value) in items.items():
            if isinstance(value, (types.ModuleType, Fresh)):
                continue
            try:
                cloudpickle.dumps(value)
            except Exception as exc:
                kind = type(value).__qualname__
                return type(error)(UNPICKLABLE_GLOBAL.format(
                    func=func.__qualname__, name=name, kind=kind, reason=exc))
    return error


# --------------------------------------------------------------------------- receiving


def _make_function(key: Key, code: Any, name: str, closure: Any) -> Any:
    """The function ``key`` bound to this process's notebook namespace: the one rebuilt
    before when its code is the same (a function shipped again is the same object)."""
    if key[0] == PROCESS:  # one of ours, back home
        ref = LEDGER.home.get(key)
        home = ref() if ref is not None else None
        # the same code, though perhaps not the same object: marshal's output depends on
        # reference counts, so a code object that went there and back may be a copy
        if home is not None and (home.__code__ is code or home.__code__ == code):
            return home
    with LEDGER.lock:
        func = LEDGER.rebuilt.get(key)
        if func is not None and func.__code__ == code and func.__globals__ is namespace() \
                and (func.__closure__ is None) == (closure is None):
            return func
        ns = namespace()
        ns.setdefault("__builtins__", __builtins__)
        func = types.FunctionType(code, ns, name, None, closure)
        LEDGER.rebuilt[key] = func
        LEDGER.keys[func] = key
        return func


def _set_function_state(func: Any, state: dict[str, Any]) -> None:
    key = LEDGER.keys.get(func, ("", 0))
    if key[0] == PROCESS:
        ref = LEDGER.home.get(key)
        if ref is not None and ref() is func:
            return  # one of ours, back home: it is as it was (its globals are ours)
    for module in state["submodules"]:
        importlib.import_module(module)
    take(state["globals"])
    func.__dict__.update(state["attrs"])
    for slot, value in state["slots"].items():
        setattr(func, slot, value)
    if func.__closure__ is not None:
        for cell, value in zip(func.__closure__, state["closure"], strict=False):
            cell.cell_contents = value


def take(items: dict[str, tuple[Any, Any]]) -> None:
    """Merge shipped globals into this process's namespace by the rule in the module's
    docstring."""
    ns = namespace()
    ledger = LEDGER
    with ledger.lock:
        for name, (tag, value) in items.items():
            if tag is None:  # a module
                ns.setdefault(name, value)
                continue
            origin, version = tag
            if origin == PROCESS:
                continue  # our own value
            if ledger.seen.get((origin, name), 0) >= version and name in ns:
                continue  # an assignment this process took already (or changed since)
            ledger.seen[(origin, name)] = version
            obj = value.make() if isinstance(value, Fresh) else value
            ns[name] = obj
            ledger.received[name] = (tag, obj)
