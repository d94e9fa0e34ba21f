"""What a value is, in a few words: type, shape, dtype, device, size and a short preview,
computed where the value lives (an RRef's owner) for the notebook's display."""

from __future__ import annotations

from typing import Any

MAX_PREVIEW = 400


def describe(value: Any) -> dict[str, Any]:
    """A short, display-ready description of ``value``."""
    import torch

    cls = type(value)
    mod = cls.__module__
    tname = cls.__qualname__ if mod in ("builtins", "__main__") else f"{mod}.{cls.__qualname__}"
    info: dict[str, Any] = {"type": tname}
    if isinstance(value, torch.Tensor):
        from rpcnb._torch import tensor_preview

        info.update(
            shape=list(value.shape),
            dtype=str(value.dtype).replace("torch.", ""),
            device=str(value.device),
            nbytes=value.element_size() * value.nelement(),
            requires_grad=bool(value.requires_grad),
        )
        preview = tensor_preview(value)
    else:
        try:
            preview = repr(value)
        except Exception as exc:  # a broken __repr__ must not break the display
            preview = f"<repr failed: {exc!r}>"
        if hasattr(value, "__len__"):
            try:
                info["len"] = len(value)
            except Exception:
                pass
    if len(preview) > MAX_PREVIEW:
        preview = preview[: MAX_PREVIEW - 3] + "..."
    info["preview"] = preview
    return info
