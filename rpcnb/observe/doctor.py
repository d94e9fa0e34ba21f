"""``%rpc_doctor``: what on each member can slow or break the group, and what to do.

Every member answers the ``doctor`` request with ``local_report()``: plain facts read on
that process (``/dev/shm``, ptrace scope, container markers, CUDA, InfiniBand devices and
ports, RDMA fork-safety variables, ``TP_SOCKET_IFNAME``, versions, its clock). ``findings``
turns the reports into findings, each with a level (``ok``, ``note``, ``warn``) and what to
do; it is a pure function of the reports, one small function per kind of finding: those
that read one member's report (``MEMBER_CHECKS``), then those that compare them all
(``GROUP_CHECKS``). ``check()`` asks every live member and adds the
leader's own checks (the connection file's mode, where the group listens) and the clock
skew measured against this process.
"""

from __future__ import annotations

import os
import platform
import socket
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from rpcnb import docs, machine, settings, text
from rpcnb.session import protocol, roster, state

SMALL_SHM = 1 << 30  # below 1 GiB of /dev/shm, large tensors fall back or fail
SKEW_S = 0.5  # clocks further apart than this confuse logs and timelines
CONTAINER_FILES = ("/.dockerenv", "/run/.containerenv")


@dataclass
class Finding:
    member: str
    check: str
    level: str  # "ok", "note" or "warn"
    detail: str
    todo: str = ""


def _container() -> str:
    """Why this process looks like it runs in a container ('' when it does not)."""
    why = [path for path in CONTAINER_FILES if os.path.exists(path)]
    if settings.other("container"):
        why.append(f"container={settings.other('container')}")
    cgroup = machine.read_file("/proc/1/cgroup") or ""
    why += [f"/proc/1/cgroup mentions {word}"
            for word in ("docker", "kubepods", "containerd", "libpod") if word in cgroup]
    return ", ".join(why)


def _ib_ports() -> dict[str, list[str]]:
    """InfiniBand device -> 'PORT: STATE' of each of its ports."""
    out: dict[str, list[str]] = {}
    for dev in machine.ib_devices():
        base = f"/sys/class/infiniband/{dev}/ports"
        try:
            ports = sorted(os.listdir(base))
        except OSError:
            ports = []
        out[dev] = [f"{p}: {machine.read_file(f'{base}/{p}/state') or '?'}" for p in ports]
    return out


def local_report() -> dict[str, Any]:
    """This process's facts for the doctor (runs on every member)."""
    try:
        st = os.statvfs(machine.SHM_DIR)
        shm_total, shm_free = st.f_frsize * st.f_blocks, st.f_frsize * st.f_bavail
    except OSError:
        shm_total = shm_free = -1
    scope = machine.read_file("/proc/sys/kernel/yama/ptrace_scope")
    torch = sys.modules.get("torch")
    cuda_init = bool(torch is not None and torch.cuda.is_initialized())
    s = state.active()
    return {
        "name": s.name if s is not None else "", "host": socket.gethostname(),
        "pid": os.getpid(), "shm_total": shm_total, "shm_free": shm_free,
        "ptrace_scope": int(scope) if scope and scope.isdigit() else None,
        "container": _container(), "ib": _ib_ports(),
        "fork_safe": {v: settings.other(v) for v in ("RDMAV_FORK_SAFE", "IBV_FORK_SAFE")
                      if settings.is_set(v)},
        "cuda_initialized": cuda_init,
        "cuda_visible": settings.other("CUDA_VISIBLE_DEVICES")
        if settings.is_set("CUDA_VISIBLE_DEVICES") else None,
        "socket_ifname": settings.other("TP_SOCKET_IFNAME"),
        "torch": getattr(torch, "__version__", "") if torch is not None else "",
        "torch_git": getattr(getattr(torch, "version", None), "git_version", "") or "",
        "python": platform.python_version(), "time": time.time(),
        "platform": f"{platform.system()} {platform.machine()}",
        "settings": settings.set_now(), "settings_wrong": settings.problems(),
    }


def findings(reports: dict[str, dict[str, Any]]) -> list[Finding]:
    """The findings for the members' reports (``local_report`` of each, by name; a report
    may carry ``skew_s``, ``address`` and ``kind`` added by ``check``): each member's, in
    the order of ``MEMBER_CHECKS``, then the group's (``GROUP_CHECKS``)."""
    out = [found for name, r in reports.items() for look in MEMBER_CHECKS
           for found in look(name, r)]
    for look_at_all in GROUP_CHECKS:
        out += look_at_all(reports)
    return out


# -- what each member's report says --------------------------------------------------------


def _settings(name: str, r: dict[str, Any]) -> list[Finding]:
    """The RPCNB_* variables set there, and any it cannot read."""
    said = r.get("settings") or {}
    if not said:
        return []
    return [Finding(name, "settings", "warn" if r.get("settings_wrong") else "note",
                    ", ".join(f"{k}={v}" for k, v in said.items()),
                    "; ".join(r.get("settings_wrong") or []))]


def _shm(name: str, r: dict[str, Any]) -> list[Finding]:
    said = (f"{text.size(r.get('shm_total', 0), 'MB', 0)} "
            f"({text.size(r.get('shm_free', 0), 'MB', 0)} free)")
    if r["shm_total"] < 0:
        return [Finding(name, "/dev/shm", "warn", "no /dev/shm",
                        "mount a tmpfs on /dev/shm, or use --no-shm")]
    if r["shm_total"] < SMALL_SHM:
        return [Finding(name, "/dev/shm", "warn", said,
                        "containers default to 64 MB: run with --shm-size=8g (docker) or a "
                        "larger tmpfs; tensors larger than what is free go over TensorPipe")]
    return [Finding(name, "/dev/shm", "ok", said)]


def _cma(name: str, r: dict[str, Any]) -> list[Finding]:
    """Whether TensorPipe's cma channel may read other members' memory (ptrace scope)."""
    scope = r["ptrace_scope"]
    if scope is not None and scope >= 2:
        return [Finding(name, "cma", "warn", f"ptrace_scope={scope}: TensorPipe's cma channel "
                        "cannot read other members' memory",
                        "echo 1 > /proc/sys/kernel/yama/ptrace_scope (as root), or tensors "
                        "between members on this host take the slower mpt_uv")]
    if scope == 1:
        return [Finding(name, "cma", "note", "ptrace_scope=1: cma works between processes of "
                        "the same user that rpcnb started (they are dumpable)",
                        "if %rpc_channels shows basic where you expect cma, set ptrace_scope "
                        "to 0")]
    return [Finding(name, "cma", "ok", "no yama restriction" if scope is None
                    else "ptrace_scope=0")]


def _in_container(name: str, r: dict[str, Any]) -> list[Finding]:
    if not r["container"]:
        return []
    return [Finding(name, "container", "note", f"runs in a container ({r['container']})",
                    "check /dev/shm's size and that the members can reach each other's ports")]


def _cuda(name: str, r: dict[str, Any]) -> list[Finding]:
    if not (r["cuda_initialized"] and r.get("kind") in ("kernel", None)):
        return []
    return [Finding(name, "cuda", "note", "CUDA is initialised in this process",
                    "rpcnb forks its workers from a launcher that never initialises CUDA, so "
                    "this is safe for them; do not fork (multiprocessing 'fork') after using "
                    "CUDA")]


def _infiniband(name: str, r: dict[str, Any]) -> list[Finding]:
    """The HCAs and their ports, and whether a fork is safe with RDMA."""
    ib = r["ib"]
    if not ib:
        return []
    out = [Finding(name, "infiniband", "warn" if len(ib) > 1 else "ok",
                   "; ".join(f"{d} ({', '.join(p) or 'no ports'})" for d, p in ib.items()),
                   "TensorPipe's ibv uses the first device only: with several HCAs, give each "
                   "member the one near its GPU (e.g. export UCX_NET_DEVICES / restrict the "
                   "devices it sees)" if len(ib) > 1 else "")]
    if not r["fork_safe"]:
        out.append(Finding(name, "rdma fork", "warn", "RDMAV_FORK_SAFE is not set",
                           "export RDMAV_FORK_SAFE=1 before starting the kernel and workers: a "
                           "fork with registered memory corrupts RDMA transfers"))
    return out


def _interface(name: str, r: dict[str, Any]) -> list[Finding]:
    where = r.get("address") or ""
    iface = r["socket_ifname"] or "(unset: the interface the host name resolves to)"
    return [Finding(name, "interface", "ok" if r["socket_ifname"] else "note",
                    f"listens on {where or '?'}; TP_SOCKET_IFNAME={iface}",
                    "" if r["socket_ifname"] else "give --interface (or --host) to choose it")]


def _clock(name: str, r: dict[str, Any]) -> list[Finding]:
    skew = r.get("skew_s")
    if skew is None:
        return []
    late = abs(skew) > SKEW_S
    return [Finding(name, "clock", "warn" if late else "ok",
                    f"{skew * 1000:+.0f} ms against the leader",
                    "run an NTP client (chrony) on both hosts" if late else "")]


# -- what the reports say together ---------------------------------------------------------


def _versions(reports: dict[str, dict[str, Any]]) -> list[Finding]:
    """One torch and one Python everywhere, and one rpcnb was tested with."""
    versions = {(r["torch"], r["torch_git"], r["python"]) for r in reports.values()}
    if len(versions) > 1:
        return [Finding(name, "versions", "warn",
                        f"torch {r['torch']} ({r['torch_git'][:8]}), python {r['python']}",
                        "install the same torch (and with it TensorPipe) and Python on every "
                        "member: pickles and the RPC wire format differ")
                for name, r in reports.items()]
    if not reports:
        return []
    torch_v, git, py = versions.pop()
    tested = tested_torch(torch_v)
    return [Finding("all", "versions", "ok" if tested else "note",
                    f"torch {torch_v} ({git[:8]}), python {py}",
                    "" if tested else f"rpcnb was tested with torch {TESTED_TORCH}: see "
                    + docs.ref("getting-started", "platforms"))]


def _platforms(reports: dict[str, dict[str, Any]]) -> list[Finding]:
    platforms = {r.get("platform", "") for r in reports.values()} - {""}
    if not platforms:
        return []
    return [Finding("all", "platform", "ok", ", ".join(sorted(platforms)) +
                    " (rpcnb runs on Linux only: " +
                    docs.ref("getting-started", "platforms") + ")")]


# Each looks at one member's report; a new kind of finding is a function here and a row.
MEMBER_CHECKS: tuple[Callable[[str, dict[str, Any]], list[Finding]], ...] = (
    _settings, _shm, _cma, _in_container, _cuda, _infiniband, _interface, _clock)
# Each looks at every member's report at once.
GROUP_CHECKS: tuple[Callable[[dict[str, dict[str, Any]]], list[Finding]], ...] = (
    _versions, _platforms)


TESTED_TORCH = "2.13 and 2.14"  # make compat's range (pyproject.toml, docs/contributing.md)


def tested_torch(version: str) -> bool:
    """Whether ``version`` (``2.14.1+cu130``) is a torch release rpcnb was tested with."""
    return version.split("+")[0].rsplit(".", 1)[0] in ("2.13", "2.14")


def leader_findings(s: state.Session) -> list[Finding]:
    """The checks only the group's first member can make: its secret and its store."""
    out: list[Finding] = []
    path = s.connection_path
    if path is not None:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError:
            mode = -1
        if mode < 0:
            out.append(Finding(s.name, "token", "note", f"the connection file {path} is gone"))
        elif mode & 0o077:
            out.append(Finding(s.name, "token", "warn", f"{path} has mode {oct(mode)}",
                               f"chmod 600 {path}: it holds the group's secret"))
        else:
            out.append(Finding(s.name, "token", "ok", f"{path} is private (mode {oct(mode)})"))
    where = s.init_method
    if where.startswith("tcp://"):
        host = where[6:].rsplit(":", 1)[0]
        if host in ("127.0.0.1", "localhost", "::1"):
            out.append(Finding(s.name, "ports", "ok", f"the group meets on {where} (loopback)"))
        else:
            out.append(Finding(s.name, "ports", "note", f"the group meets on {where}",
                               "other hosts reach it there: keep that network private "
                               f"({docs.ref('security')}); traffic is not encrypted"))
    else:
        out.append(Finding(s.name, "ports", "ok", "the group meets through a private file "
                           "(no network port for the store)"))
    return out


def check(timeout: float = 10.0) -> list[Finding]:
    """Ask every live member for its report and return all findings, the leader's first."""
    s = state.current()
    members = roster.live_names(s)
    t0 = time.time()
    futs = {n: protocol.call_async(s.token, n, "doctor", timeout=timeout)
            for n in members if n != s.name}
    reports = {s.name: local_report()}
    for name, fut in futs.items():
        reports[name] = fut.wait()
        back = time.time()
        # the member read its clock between t0 and back: compare with the midpoint
        reports[name]["skew_s"] = (reports[name]["time"] - (t0 + back) / 2
                                   if back - t0 < 2 * SKEW_S else None)
    known = {m.name: m for m in s.records()}
    for name, r in reports.items():
        m = known.get(name)
        r["address"], r["kind"] = (m.address, m.kind) if m else ("", None)
    return leader_findings(s) + findings(reports)


def to_json(found: list[Finding]) -> list[dict[str, Any]]:
    return [asdict(f) for f in found]


def describe(found: list[Finding]) -> str:
    """The findings as text, problems first, each with what to do."""
    order = {"warn": 0, "note": 1, "ok": 2}
    lines = []
    for f in sorted(found, key=lambda f: order.get(f.level, 3)):
        mark = {"warn": "!!", "note": "--", "ok": "ok"}.get(f.level, "?")
        lines.append(f"{mark} {f.member:<10} {f.check:<11} {f.detail}")
        if f.todo:
            lines.append(f"{'':14}{'':11} -> {f.todo}")
    warns = sum(f.level == "warn" for f in found)
    lines.append(f"{warns} problem{'s' if warns != 1 else ''} found" if warns else
                 "nothing to fix")
    return "\n".join(lines)
