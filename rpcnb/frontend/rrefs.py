"""How RRefs look in a notebook: owner, type, and for tensors shape, dtype, device, size.

The description is computed where the value lives (one small RPC to the owner), so it is
always current and works for any RRef, not only rpcnb's.
"""

from __future__ import annotations

import html
from typing import Any

from rpcnb import text


def describe_rref(rref: Any) -> tuple[str, dict[str, Any] | None, str]:
    """(owner name, description or None, error text) of an RRef."""
    from rpcnb.observe import values
    from rpcnb.session import protocol, state

    try:
        owner = rref.owner_name()
    except Exception as exc:  # pragma: no cover - an RRef always has an owner
        return "?", None, str(exc)
    try:
        if rref.is_owner():
            return owner, values.describe(rref.local_value()), ""
        info = protocol.call(state.current().token, owner, "describe_rref", rref, timeout=5)
        return owner, info, ""
    except Exception as exc:
        return owner, None, f"unreachable: {str(exc).splitlines()[0] if str(exc) else exc!r}"


def time_limit(nbytes: int) -> float:
    """The time limit to fetch a value of ``nbytes`` bytes (``rref.to_here(timeout=...)``):
    the group's RPC timeout, grown by its size (``rpcnb.wire.limits``)."""
    import torch.distributed.rpc as rpc

    from rpcnb.wire import limits

    return limits.grown(rpc.get_rpc_timeout(), nbytes)


def summary_line(owner: str, info: dict[str, Any] | None, error: str = "") -> str:
    if info is None:
        return f"RRef on {owner} ({error})"
    parts = [f"RRef on {owner}: {info['type']}"]
    if "shape" in info:
        parts.append(f"shape={text.shape(info['shape'])}")
        parts.append(info["dtype"])
        parts.append(info["device"])
        parts.append(text.size(info["nbytes"]))
    elif "len" in info:
        parts.append(f"len={info['len']}")
    return " ".join(parts)


def rref_text(rref: Any) -> str:
    owner, info, error = describe_rref(rref)
    head = summary_line(owner, info, error)
    if info is None:
        return head
    return head + "\n" + info["preview"]


def rref_pretty(rref: Any, p: Any, cycle: bool) -> None:
    p.text(rref_text(rref))


def rref_html(rref: Any) -> str:
    owner, info, error = describe_rref(rref)
    esc = html.escape
    if info is None:
        return (f"<div class='rpcnb-rref'><b>RRef</b> on <code>{esc(owner)}</code> "
                f"<i>{esc(error)}</i></div>")
    facts = [("owner", owner), ("type", info["type"])]
    if "shape" in info:
        facts += [("shape", text.shape(info["shape"])),
                  ("dtype", info["dtype"]), ("device", info["device"]),
                  ("size", text.size(info["nbytes"]))]
    elif "len" in info:
        facts.append(("len", str(info["len"])))
    cells = "".join(f"<td style='padding:0 .8em 0 0'><span style='opacity:.6'>{esc(k)}</span> "
                    f"<code>{esc(str(v))}</code></td>" for k, v in facts)
    return ("<div class='rpcnb-rref'><b>RRef</b><table style='margin:0'><tr>" + cells +
            "</tr></table><pre style='margin:.2em 0 0 0'>" + esc(info["preview"]) +
            "</pre></div>")


def register(ip: Any) -> None:
    """Show RRefs with ``rref_pretty``/``rref_html``. By the type's name, so that nothing
    heavy is imported: rpc.remote returns torch._C._distributed_rpc.PyRRef."""
    formatters = ip.display_formatter.formatters
    formatters["text/plain"].for_type_by_name("torch._C._distributed_rpc", "PyRRef", rref_pretty)
    formatters["text/html"].for_type_by_name("torch._C._distributed_rpc", "PyRRef", rref_html)
