"""Every environment variable rpcnb reads, in two tables, each read one way: its own
``RPCNB_*`` variables (``SETTINGS``), and the other tools' it reads or sets for its
processes (``BORROWED``: TensorPipe's interface, CUDA's visible devices, UCX's, ...).

A yes-or-no setting takes ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``
(any case; empty: its default); a number must be one (above 0 where it is a size, a
rate or a time). Anything else is a ``ValueError`` that names the variable and says what
it takes. ``docs/settings.md``'s table of variables is written from ``SETTINGS``
(``scripts/settings_table.py``), and ``%rpc_doctor`` shows the ones set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

YES = ("1", "true", "yes", "on")
NO = ("0", "false", "no", "off")
BAD_FLAG = "{name}={value!r} is not a yes or no: write 1, true, yes or on, or 0, false, no or off."
BAD_NUMBER = "{name}={value!r} is not {what}: write a number above 0 (e.g. {default})."


@dataclass(frozen=True)
class Setting:
    """One variable: its name, kind (``flag``, ``int``, ``float``, ``path``, ``text``),
    default, and what it does (a line of the settings page)."""

    name: str
    kind: str
    default: Any
    doc: str
    shown_default: str = ""  # how the page shows the default, where not the value itself

    def page_default(self) -> str:
        if self.shown_default:
            return self.shown_default
        if self.kind == "flag":
            return "on" if self.default else "off"
        return f"`{self.default}`"


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("RPCNB_SHM", "flag", True, "large CPU tensors go through rpcnb's shared memory "
            "(off: over TensorPipe; `%rpc_init --no-shm` too)"),
    Setting("RPCNB_SHM_THRESHOLD", "int", 1 << 20,
            "bytes from which a CPU tensor takes the shared-memory path"),
    Setting("RPCNB_SHM_POOL_BYTES", "int", 4 << 30, "at most this much shared memory per process"),
    Setting("RPCNB_SHM_IDLE_S", "float", 30.0, "seconds after which an unused buffer (and a "
            "mapping of another member's) is given back"),
    Setting("RPCNB_ZERO_COPY", "flag", True, "a tensor already in shared memory goes to a "
            "same-host member by handle, sharing its pages (off: copied; `%rpc_init "
            "--no-zero-copy` too)"),
    Setting("RPCNB_ZERO_COPY_HOLD_S", "float", 30.0, "seconds a sender holds a storage it sent "
            "by handle in a reply, for the receiver to map it"),
    Setting("RPCNB_UCX", "flag", False, "large tensors go over UCX ({doc}`ucx`; `%rpc_init "
            "--ucx` too; needs `pip install 'rpcnb[ucx]'`, or `'rpcnb[ucx-cu13]'` for a CUDA "
            "13 torch)"),
    Setting("RPCNB_UCX_THRESHOLD", "int", 1 << 20, "bytes from which a tensor takes the UCX path"),
    Setting("RPCNB_UCX_TCP_THRESHOLD", "int", 32 << 20, "bytes from which a tensor takes UCX "
            "to a peer it reaches over TCP (below it TensorPipe's TCP is faster; {doc}`ucx`)"),
    Setting("RPCNB_UCX_POOL_BYTES", "int", 1 << 30, "receive buffers of the UCX path kept for "
            "reuse, at most (past it a receive gets a fresh tensor)"),
    Setting("RPCNB_UCX_IDLE_S", "float", 30.0, "seconds after which an unused UCX receive "
            "buffer is given back (at the next receive, and all at shutdown)"),
    Setting("RPCNB_CALL_TIMES", "flag", False, "time every plain `rpc_sync`, `rpc_async` and "
            "`remote` call; off, they are counted, and timed only while a channel monitor or "
            "the panel looks (a monitor's question turns it on there for 10 s). Remote cells "
            "are always timed"),
    Setting("RPCNB_MIN_RATE", "float", float(1 << 20), "bytes per second a call's payload is "
            "assumed to reach at least: a call that carries one gets the group's RPC timeout "
            "plus its bytes at this rate ({doc}`security`, \"Slow and lossy links\")",
            "`1048576`"),
    Setting("RPCNB_PROGRESS_DELAY", "float", 0.5, "seconds a `--push`/`--fetch` of 100 MB or "
            "more (8 MB across hosts) runs before its bar shows (0: at once)"),
    Setting("RPCNB_PROFILE_DIR", "path", "rpcnb-profiles", "where `%%remote --profile` writes "
            "each worker's trace (and `all.json`), on the kernel's host",
            "`./rpcnb-profiles`"),
    Setting("RPCNB_RUNTIME_DIR", "path", "", "this user's private folder: the `rpcnb` kernel's "
            "namespace holder and ipc sockets ({doc}`security`), the kept groups' records",
            "`$XDG_RUNTIME_DIR/rpcnb`, else `/tmp/rpcnb-run-UID`"),
    Setting("RPCNB_ISOLATION", "text", "", "set by the `rpcnb` kernel's launcher: what it did "
            "(a private network namespace, or why not); read by "
            "`rpcnb.sandbox.isolation.status()`", "set for you"),
)}


@dataclass(frozen=True)
class Borrowed:
    """A variable of another tool that rpcnb reads, or sets for its own processes: its
    name, what rpcnb does when it is unset (a line of the settings page), and what it does."""

    name: str
    default: str
    doc: str


# Read with ``other`` (and set, where rpcnb sets one, with ``set_default`` or the group's
# Session.set_env); docs/settings.md's second table is written from it.
BORROWED: dict[str, Borrowed] = {b.name: b for b in (
    Borrowed("TP_SOCKET_IFNAME", "set to `lo` by rpcnb unless set", "the interface "
             "TensorPipe listens on; a group started with `--host` sets it for its own "
             "members only"),
    Borrowed("CUDA_VISIBLE_DEVICES", "inherited", "which GPUs a process sees; `%rpc_init "
             "--gpus` sets it per worker"),
    Borrowed("UCX_NET_DEVICES", "the group's interface (`lo` on one host)", "where UCX's TCP "
             "transport listens and connects; set it to override rpcnb's choice"),
    Borrowed("UCX_RNDV_SCHEME", "`put_zcopy` in a kernel on one host without GPUs, else "
             "UCX's own", "how UCX moves a large message; set, it wins over rpcnb's choice "
             "({doc}`ucx`)"),
    Borrowed("UCX_RNDV_FRAG_MEM_TYPE", "`host` on a machine without GPUs, unless set",
             "where UCX stages a large message's fragments (ucxx asks for CUDA memory)"),
    Borrowed("UCX_WARN_UNUSED_ENV_VARS", "`n` unless set", "UCX's warning about variables it "
             "does not use"),
    Borrowed("TORCH_CPP_LOG_LEVEL", "set to `ERROR` by rpcnb unless set", "silences "
             "TensorPipe's `eof` warning on every graceful leave"),
    Borrowed("IBV_FORK_SAFE", "set in workers where InfiniBand devices exist", "libibverbs' "
             "fork safety (with `RDMAV_FORK_SAFE`)"),
    Borrowed("RDMAV_FORK_SAFE", "set in workers where InfiniBand devices exist", "libibverbs' "
             "fork safety (with `IBV_FORK_SAFE`)"),
    Borrowed("PYTORCH_NVML_BASED_CUDA_CHECK", "set to `1` in the warm launcher only",
             "`torch.cuda.is_available()` asks NVML instead of creating a CUDA context, so "
             "the process that forks the workers never has one"),
    Borrowed("GLOO_SOCKET_IFNAME", "the TensorPipe interface, in workers with `--collectives`",
             "where gloo's collectives listen"),
    Borrowed("NCCL_SOCKET_IFNAME", "the TensorPipe interface, in workers with `--collectives`",
             "where NCCL's bootstrap listens"),
    Borrowed("PYTHONBREAKPOINT", "pdb, in the notebook's cell", "what `breakpoint()` on a "
             "worker opens: `0` nothing, another hook that one"),
    Borrowed("container", "unset", "set by container runtimes: `%rpc_doctor` says rpcnb runs "
             "in a container"),
)}


def other(name: str, env: Mapping[str, str] | None = None) -> str:
    """The value of another tool's variable (one of ``BORROWED``; "" when unset)."""
    if name not in BORROWED:
        raise KeyError(f"{name} is not one of the variables rpcnb reads (rpcnb.settings.BORROWED)")
    return (os.environ if env is None else env).get(name, "")


def is_set(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether another tool's variable (one of ``BORROWED``) is set, even to ""."""
    other(name, env)
    return name in (os.environ if env is None else env)


def replace(name: str, value: str | None) -> str | None:
    """Set another tool's variable (one of ``BORROWED``) in this process (None: unset it);
    what it was before (None: unset). ``Session.set_env`` sets one for a group this way."""
    before = os.environ.get(name) if is_set(name) else None
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    return before


def set_default(name: str, value: str, env: Any = None) -> None:
    """Set another tool's variable (one of ``BORROWED``) in ``env`` (this process's
    environment) unless it is set already."""
    if name not in BORROWED:
        raise KeyError(f"{name} is not one of the variables rpcnb sets (rpcnb.settings.BORROWED)")
    (os.environ if env is None else env).setdefault(name, value)


def _raw(name: str, env: Mapping[str, str] | None) -> str:
    if name not in SETTINGS:
        raise KeyError(f"{name} is not one of rpcnb's settings (rpcnb.settings.SETTINGS)")
    return (os.environ if env is None else env).get(name, "").strip()


def flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    """A yes-or-no setting (unset or empty: its default)."""
    raw = _raw(name, env)
    if not raw:
        return bool(SETTINGS[name].default)
    low = raw.lower()
    if low in YES:
        return True
    if low in NO:
        return False
    raise ValueError(BAD_FLAG.format(name=name, value=raw))


def number(name: str, env: Mapping[str, str] | None = None) -> Any:
    """A size, a rate or a time (unset or empty: its default), above 0 (0 allowed for a
    delay); an int setting stays an int."""
    s = SETTINGS[name]
    raw = _raw(name, env)
    if not raw:
        return s.default
    try:
        value = int(float(raw)) if s.kind == "int" else float(raw)
    except ValueError:
        value = None
    zero_ok = name == "RPCNB_PROGRESS_DELAY"
    if value is None or value < 0 or (value == 0 and not zero_ok):
        what = "a number of bytes" if s.kind == "int" else "a number"
        raise ValueError(BAD_NUMBER.format(name=name, value=raw, what=what, default=s.default))
    return value


def text(name: str, env: Mapping[str, str] | None = None) -> str:
    """A path or a text setting (unset: its default)."""
    return _raw(name, env) or str(SETTINGS[name].default)


def set_now(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``RPCNB_*`` variables set in ``env`` (this process's), rpcnb's or not (a typo
    shows too): what ``%rpc_doctor`` lists."""
    env = os.environ if env is None else env
    return {k: v for k, v in sorted(env.items()) if k.startswith("RPCNB_")}


def unknown(env: Mapping[str, str] | None = None) -> list[str]:
    """``RPCNB_*`` variables set that rpcnb does not read (a typo, an old name)."""
    return [k for k in set_now(env) if k not in SETTINGS]


def problems(env: Mapping[str, str] | None = None) -> list[str]:
    """What is wrong with the ``RPCNB_*`` variables set: a value rpcnb cannot read (the
    error it would raise), a name it does not read (a typo, an old name)."""
    env = os.environ if env is None else env
    found = [f"{k} is not a variable rpcnb reads (see docs/settings.md)" for k in unknown(env)]
    for name, s in SETTINGS.items():
        if name not in env:
            continue
        try:
            if s.kind == "flag":
                flag(name, env)
            elif s.kind in ("int", "float"):
                number(name, env)
        except ValueError as exc:
            found.append(str(exc))
    return found
