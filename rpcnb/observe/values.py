"""What a value is, in a few words: type, shape, dtype, device, size and a short preview,
computed where the value lives (an RRef's owner) for the notebook's display. Tensors and
DLPack arrays (NumPy, CuPy, ...) get the same facts."""

from __future__ import annotations

from typing import Any

from rpcnb.paths import arrays

MAX_PREVIEW = 400
# A device array up to this size is previewed by its own repr (a copy to the host);
# a larger one through torch's summarised printing, which moves only the corners.
SMALL_DEVICE_ARRAY = 64 << 10


def describe(value: Any, preview: bool = True) -> dict[str, Any]:
    """A short, display-ready description of ``value`` (``preview=False``: without the
    preview, which costs a repr: ``%rpc_who`` lists every variable so)."""
    import torch

    cls = type(value)
    mod = cls.__module__
    tname = cls.__qualname__ if mod in ("builtins", "__main__") else f"{mod}.{cls.__qualname__}"
    info: dict[str, Any] = {"type": tname}
    if isinstance(value, torch.Tensor):
        from rpcnb.wire._torch import tensor_preview

        info.update(
            shape=list(value.shape),
            dtype=str(value.dtype).replace("torch.", ""),
            device=str(value.device),
            nbytes=value.element_size() * value.nelement(),
            requires_grad=bool(value.requires_grad),
        )
        text = tensor_preview(value) if preview else ""
    elif arrays.library(cls) is not None:
        info.update(shape=[int(n) for n in value.shape], dtype=arrays.dtype_name(value),
                    device=arrays.device(value), nbytes=arrays.nbytes(value))
        text = array_preview(value, info["nbytes"]) if preview else ""
    else:
        text = _repr(value) if preview else ""
        if hasattr(value, "__len__"):
            try:
                info["len"] = len(value)
            except Exception:
                pass
    if not preview:
        return info
    if len(text) > MAX_PREVIEW:
        text = text[: MAX_PREVIEW - 3] + "..."
    info["preview"] = text
    return info


def _repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as exc:  # a broken __repr__ must not break the display
        return f"<repr failed: {exc!r}>"


def array_preview(array: Any, nbytes: int) -> str:
    """The array's own repr with NumPy's summarised printing (as short as a tensor's);
    for a large array on a device, torch's printing of its corners, as an ``array(...)``."""
    import numpy

    if arrays.is_host(array) or nbytes <= SMALL_DEVICE_ARRAY:
        # as short as a tensor's (rpcnb.wire._torch.tensor_preview)
        with numpy.printoptions(threshold=24, edgeitems=2, precision=4, linewidth=72):
            return _repr(array)
    tensor = arrays.as_tensor(array)
    if tensor is None:
        return f"<{type(array).__qualname__} of {nbytes} bytes on {arrays.device(array)}>"
    from rpcnb.wire._torch import tensor_preview

    text = tensor_preview(tensor)
    text = text.replace(f", device='{tensor.device}'", "").replace("dtype=torch.", "dtype=")
    return "array(" + text.removeprefix("tensor(")
