"""Ship notebook-defined code by value over torch RPC.

torch's RPC pickler sends functions and classes by reference, so a function defined in a
notebook cell fails on the other side, or silently runs the callee's own function of the
same name. rpcnb swaps in a cloudpickle-based pickler: anything defined in ``__main__``
(notebook cells, remote cells) travels by value, while tensors and RRefs keep going
through torch's own tables so device maps and channels still apply.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import io
import sys
import time
import types
from collections import ChainMap
from typing import Any

# Patch once torch's import has finished (it imports torch.distributed.rpc itself):
# patching in the middle of it would meet half-initialised modules.
_TARGET = "torch"
_installed = False


def _serialize(self: Any, obj: Any) -> tuple[bytes, list[Any]]:
    """torch's ``_InternalRPCPickler.serialize``, with cloudpickle's by-value reducers."""
    import cloudpickle
    import torch
    import torch.distributed as dist
    from torch.distributed.rpc import internal

    f = io.BytesIO()
    table = dict(self._dispatch_table)
    table[dist.rpc.PyRRef] = self._py_rref_reducer
    table[dist.rpc.RRef] = self._rref_reducer
    if isinstance(obj, torch.jit.ScriptModule):
        table[obj.__class__] = self._script_module_reducer
    table.update(self._class_reducer_dict)
    # torch's reducers return classmethods, which cloudpickle would ship by value
    # (with the thread-local tensor tables in their globals); pickle them by name.
    table[types.MethodType] = _reduce_method
    table[torch.Tensor] = functools.partial(_reduce_tensor, self._tensor_reducer)
    # cloudpickle's own table (code objects, cells, ...) sits under torch's.
    p = _pickler_class()(f, ChainMap(table, cloudpickle.Pickler.dispatch_table))

    tables = internal._thread_local_tensor_tables
    old = getattr(tables, "send_tables", None)
    tables.send_tables = []
    try:
        p.dump(obj)
        tensors = tables.send_tables
    finally:
        if old is not None:
            tables.send_tables = old
        else:
            del tables.send_tables
    return f.getvalue(), tensors


_PICKLER: Any = None


def _reduce_tensor(fallback: Any, tensor: Any) -> Any:
    """Large CPU tensors to a same-host peer take rpcnb's shared-memory path."""
    from rpcnb import shm, telemetry

    if shm.wants(tensor):
        start, t0 = telemetry.now(), time.perf_counter()
        reduced = shm.export(tensor)
        if reduced is not None:
            telemetry.record(telemetry.current_peer(), "tensor", start,
                             time.perf_counter() - t0,
                             tensor.element_size() * tensor.nelement(), channel="rpcnb_shm")
            return reduced
    return fallback(tensor)


def _reduce_method(m: types.MethodType) -> tuple[Any, tuple[Any, str]]:
    return getattr, (m.__self__, m.__func__.__name__)


def _pickler_class() -> Any:
    global _PICKLER
    if _PICKLER is None:
        import cloudpickle

        class RpcPickler(cloudpickle.Pickler):  # type: ignore[misc]
            def __init__(self, file: Any, table: Any) -> None:
                # The C pickler reads dispatch_table once, in __init__; cloudpickle's class
                # attribute would shadow a later assignment.
                self.dispatch_table = table
                super().__init__(file, protocol=cloudpickle.DEFAULT_PROTOCOL)

        _PICKLER = RpcPickler
    return _PICKLER


def install() -> None:
    """Make torch's RPC pickler ship ``__main__`` code by value (idempotent).

    Imports torch; call it only where torch is needed anyway. ``watch()`` defers it
    until the user's code imports torch itself.
    """
    global _installed
    if _installed:
        return
    from torch.distributed.rpc import internal

    pickler = internal._internal_rpc_pickler
    pickler.serialize = types.MethodType(_serialize, pickler)  # type: ignore[method-assign]
    from rpcnb import telemetry

    telemetry.install()
    _installed = True


def is_installed() -> bool:
    return _installed


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
