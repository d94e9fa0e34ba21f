"""Which frames of a traceback or stack are the user's: rpcnb's and torch RPC's own
machinery is never shown (a remote call's error, a kept failure, pdb's stack), and an
exception that torch could not send back as it is is said in words."""

from __future__ import annotations

from typing import Any


def rpc_me() -> Any:
    import torch.distributed.rpc as rpc

    return rpc.get_worker_info()


def hidden(frame: Any) -> bool:
    """Whether ``frame`` is rpcnb's or torch RPC's machinery (never shown to a user)."""
    name = frame.f_globals.get("__name__", "") or ""
    return name == "rpcnb" or name.startswith(("rpcnb.", "torch.distributed.", "concurrent."))


def user_frames(tb: Any) -> Any:
    """``tb`` from its first frame that is not ``hidden``."""
    while tb is not None and hidden(tb.tb_frame):
        tb = tb.tb_next
    return tb


def user_traceback(exc: BaseException) -> str:
    """``exc``'s traceback from its first frame that is not rpcnb's or torch RPC's."""
    import traceback

    return "".join(traceback.format_exception(type(exc), exc, user_frames(exc.__traceback__)))


AWKWARD_EXCEPTION = (
    "{func} raised {type} on {where}, which cannot be sent back as it is ({why}); its "
    "traceback there:\n{tb}"
)


def sendable(exc: Exception, func: Any, where: str) -> Exception:
    """``exc``, or, when torch could not report it (its ``__str__`` or ``__repr__`` raises,
    or it does not pickle, which aborted the process), a RuntimeError that says what it was."""
    import traceback

    import cloudpickle

    try:
        repr(exc)
        str(exc)
        cloudpickle.dumps(exc)
        return exc
    except Exception as err:
        te = traceback.TracebackException.from_exception(exc)  # formats a bad str safely
        return RuntimeError(AWKWARD_EXCEPTION.format(
            func=getattr(func, "__qualname__", repr(func)), type=type(exc).__qualname__,
            where=where, why=f"{type(err).__name__}: {err}", tb="".join(te.format()).rstrip()))
