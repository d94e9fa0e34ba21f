"""Arrays that speak DLPack (NumPy, CuPy, JAX, ...) travel as tensors.

The sender wraps such an array as a torch tensor over the same memory
(``torch.from_dlpack``, no copy), so it takes the path a tensor of its device takes:
rpcnb's shared memory for a large CPU one on one host, TensorPipe's device-mapped CUDA
channels for a CUDA one, the RPC tensor table otherwise. The receiver hands it on as the
same array type, on the device it arrived on, with the array library's own
``from_dlpack``. What DLPack refuses (object, string, byte-swapped or padded dtypes) is
pickled as it always was, and so are subclasses of NumPy's and CuPy's arrays (a mask, a
file, matrix rules: more than the data).

Copy semantics are the tensors': the receiver's array lives in memory of its own (or in a
shared-memory buffer that goes back when the array is freed). Arrays with negative or
zero strides (reversed views, broadcasts) are copied first: torch cannot wrap the first,
and the second would arrive as an array whose elements alias each other.

Nothing here imports an array library. A type is recognised once, by its ``__dlpack__``
and the name of its module (``library``); the library is imported where its arrays
arrive.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

# Array types whose subclasses carry more than their data: those are pickled.
_BASES = frozenset({("numpy", "ndarray"), ("cupy", "ndarray")})
# Where an array type's ``from_dlpack`` is not in its top-level package.
_LIBRARIES = MappingProxyType({"jaxlib": "jax.numpy", "jax": "jax.numpy"})
# DLPack device types (dlpack.h): kDLCPU, kDLCUDA, kDLCUDAHost, kDLROCM, kDLCUDAManaged;
# torch calls ROCm devices "cuda" too
_DEVICES = MappingProxyType({1: "cpu", 2: "cuda", 3: "cpu", 10: "cuda", 13: "cuda"})
_HOST = (1, 3)


class _Switch:
    """Whether arrays travel as tensors in this process (``set_enabled``)."""

    on = True


# the process's, as docs/arrays.md says (set in the process that sends, whatever group
# it is in): a way out, and what benches compare with
_SWITCH = _Switch()


def set_enabled(flag: bool) -> None:
    """Turn the tensor path for arrays on or off (off: arrays are pickled into the
    message as their library pickles them; for comparisons, and as a way out)."""
    _SWITCH.on = bool(flag)


def is_enabled() -> bool:
    return _SWITCH.on


def _classify(cls: type) -> str | None:
    """The module whose ``from_dlpack`` rebuilds arrays of type ``cls``, or None when
    ``cls`` is not an array that travels as a tensor. Decided once per type: the pickler
    asks for every object of every message."""
    try:
        if not (hasattr(cls, "__dlpack__") and hasattr(cls, "__dlpack_device__")):
            return None
    except Exception:  # a metaclass whose __getattr__ raises something else
        return None
    module = getattr(cls, "__module__", None)
    if not isinstance(module, str):
        return None
    top = module.split(".")[0]
    if top == "torch":
        return None  # tensors take their own path already
    for base in cls.__mro__[1:]:
        if (getattr(base, "__module__", None), getattr(base, "__qualname__", None)) in _BASES:
            return None
    name = _LIBRARIES.get(top, top)
    lib = sys.modules.get(name)
    if lib is None and name not in _LIBRARIES.values():
        return None
    if lib is not None and not callable(getattr(lib, "from_dlpack", None)):
        return None
    return name


# decided once per type (a notebook that makes classes in a loop makes the oldest go)
library: Callable[[type], str | None] = functools.lru_cache(maxsize=10_000)(_classify)


def _negative_or_zero_strides(shape: Any, strides: Any) -> bool:
    return any(s <= 0 and n > 1 for n, s in zip(shape, strides, strict=False))


def as_tensor(array: Any) -> Any:
    """``array`` as a torch tensor over its memory (a copy first for negative or zero
    strides), or None when DLPack refuses it."""
    import torch

    try:
        strides = getattr(array, "strides", None)
        if strides is None and array.__dlpack_device__()[0] in _HOST:
            # no strides to check (array_api_strict, JAX): NumPy reads the export and
            # says them (torch aborts the process on a negative stride)
            import numpy

            array = numpy.from_dlpack(array)
            strides = array.strides
        if strides is not None and _negative_or_zero_strides(array.shape, strides):
            array = array.copy()
        return torch.from_dlpack(array)
    except Exception:  # BufferError, TypeError, ...: what DLPack refuses is pickled
        return None


def reduce_array(array: Any, lib: str, host: bool = False) -> tuple[Any, tuple[str, Any]] | None:
    """The pickle reduction of an array of library ``lib``: its tensor, rebuilt as the
    array where it arrives (None: pickle it as before). ``host``: send a device array's
    data as a CPU tensor (no device map reaches the peer from its device)."""
    if not _SWITCH.on:
        return None
    tensor = as_tensor(array)
    if tensor is None:
        return None
    if host and tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return rebuild, (lib, tensor)


def rebuild(lib: str, tensor: Any) -> Any:
    """On the receiver: the tensor as an array of ``lib``, over the same memory."""
    from_dlpack = _from_dlpack(lib)
    try:
        return from_dlpack(tensor)
    except Exception:
        # a device map moved it where the library does not live (a CUDA tensor for
        # NumPy, a CPU one for CuPy): NumPy takes a host copy, others a device one
        if tensor.device.type != "cpu":
            return from_dlpack(tensor.cpu())
        import numpy

        return importlib.import_module(lib).asarray(numpy.from_dlpack(tensor))


@functools.cache
def _from_dlpack(lib: str) -> Any:
    """``lib``'s ``from_dlpack``, imported where its first array arrives."""
    return importlib.import_module(lib).from_dlpack


def device(array: Any) -> str:
    """Where ``array`` lives, as torch names devices (``cpu``, ``cuda:0``)."""
    kind, index = array.__dlpack_device__()
    name = _DEVICES.get(int(kind))
    if name is None:
        return f"dlpack device {int(kind)}:{int(index)}"
    return name if name == "cpu" else f"{name}:{int(index)}"


def is_host(array: Any) -> bool:
    return int(array.__dlpack_device__()[0]) in _HOST


def dtype_name(array: Any) -> str:
    dtype = array.dtype
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]


def nbytes(array: Any) -> int:
    n = getattr(array, "nbytes", None)
    if isinstance(n, int):
        return n
    tensor = as_tensor(array)
    return 0 if tensor is None else tensor.element_size() * tensor.nelement()
