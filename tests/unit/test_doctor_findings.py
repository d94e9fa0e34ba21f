"""%rpc_doctor's findings as a pure function of the members' reports
(rpcnb/observe/doctor.py): each member's checks in their order, then the group's; a report
with nothing to say about a kind gives no finding of it (tests/kernel/test_doctor.py asks
real members)."""

from __future__ import annotations

from typing import Any

from rpcnb.observe import doctor


def report(**changes: Any) -> dict[str, Any]:
    """A member's report with nothing wrong in it, and ``changes``."""
    r: dict[str, Any] = {
        "settings": {}, "settings_wrong": [], "shm_total": 8 << 30, "shm_free": 4 << 30,
        "ptrace_scope": 0, "container": "", "cuda_initialized": False, "ib": {},
        "fork_safe": {}, "socket_ifname": "lo", "torch": "2.14.1+cu130",
        "torch_git": "0123456789ab", "python": "3.12.1", "time": 0.0,
        "platform": "Linux x86_64",
    }
    r.update(changes)
    return r


def test_each_members_checks_in_order_then_the_groups():
    found = doctor.findings({"worker0": report(settings={"RPCNB_UCX": "1"}, skew_s=0.0),
                             "worker1": report(container="/.dockerenv", shm_total=64 << 20)})
    assert [(f.member, f.check) for f in found] == [
        ("worker0", "settings"), ("worker0", "/dev/shm"), ("worker0", "cma"),
        ("worker0", "interface"), ("worker0", "clock"),
        ("worker1", "/dev/shm"), ("worker1", "cma"), ("worker1", "container"),
        ("worker1", "interface"),
        ("all", "versions"), ("all", "platform")]
    assert [f.level for f in found if f.member == "worker1"][:1] == ["warn"]


def test_different_versions_are_a_warning_on_every_member():
    found = doctor.findings({"worker0": report(), "worker1": report(torch="2.13.0")})
    versions = [f for f in found if f.check == "versions"]
    assert [(f.member, f.level) for f in versions] == [("worker0", "warn"), ("worker1", "warn")]


def test_no_reports_no_findings():
    assert doctor.findings({}) == []


def test_every_check_is_a_small_function_of_the_reports():
    r = report(ib={"mlx5_0": ["1: ACTIVE"], "mlx5_1": []}, cuda_initialized=True, skew_s=1.0)
    for look in doctor.MEMBER_CHECKS:
        assert all(f.member == "w" for f in look("w", r)), look.__name__
    for look_at_all in doctor.GROUP_CHECKS:
        assert all(f.member == "all" for f in look_at_all({"w": r})), look_at_all.__name__
