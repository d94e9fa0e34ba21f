"""Every RPCNB_* variable is read in one place (rpcnb.settings) with one grammar, and the
settings page's table is written from it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from rpcnb import settings

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import settings_table  # noqa: E402


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("true", True), ("YES", True), ("On", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("OFF", False),
])
def test_one_grammar_for_yes_and_no(value, expected):
    assert settings.flag("RPCNB_CALL_TIMES", {"RPCNB_CALL_TIMES": value}) is expected


def test_unset_or_empty_is_the_default():
    assert settings.flag("RPCNB_SHM", {}) is True
    assert settings.flag("RPCNB_SHM", {"RPCNB_SHM": ""}) is True
    assert settings.flag("RPCNB_UCX", {}) is False
    assert settings.number("RPCNB_SHM_THRESHOLD", {}) == 1 << 20


@pytest.mark.parametrize("value", ["2", "enabled", "nope", "y"])
def test_anything_else_is_an_error_naming_the_variable(value):
    with pytest.raises(ValueError, match=rf"RPCNB_ZERO_COPY={value!r} is not a yes or no"):
        settings.flag("RPCNB_ZERO_COPY", {"RPCNB_ZERO_COPY": value})


def test_numbers_are_numbers_above_zero():
    assert settings.number("RPCNB_SHM_THRESHOLD", {"RPCNB_SHM_THRESHOLD": "4096"}) == 4096
    assert isinstance(settings.number("RPCNB_SHM_THRESHOLD", {"RPCNB_SHM_THRESHOLD": "4e3"}),
                      int)
    assert settings.number("RPCNB_PROGRESS_DELAY", {"RPCNB_PROGRESS_DELAY": "0"}) == 0
    for bad in ("big", "-1", "0"):
        with pytest.raises(ValueError, match="RPCNB_SHM_IDLE_S"):
            settings.number("RPCNB_SHM_IDLE_S", {"RPCNB_SHM_IDLE_S": bad})


def test_every_variable_the_code_names_is_a_setting():
    named = set()
    for path in (ROOT / "rpcnb").rglob("*.py"):
        named.update(re.findall(r"\bRPCNB_[A-Z0-9_]+\b", path.read_text()))
    assert named - set(settings.SETTINGS) == set()


def test_no_module_reads_an_rpcnb_variable_itself():
    reads = re.compile(r"(environ(\.get)?|getenv)\(\s*[\"']RPCNB_")
    found = [str(p.relative_to(ROOT)) for p in (ROOT / "rpcnb").rglob("*.py")
             if p.name != "settings.py" and reads.search(p.read_text())]
    assert found == []


def test_the_doctor_lists_what_is_set_and_what_is_wrong():
    from rpcnb.observe import doctor

    env = {"RPCNB_SHM": "0", "RPCNB_SHMM": "1", "RPCNB_CALL_TIMES": "maybe", "PATH": "/bin"}
    assert settings.set_now(env) == {"RPCNB_CALL_TIMES": "maybe", "RPCNB_SHM": "0",
                                     "RPCNB_SHMM": "1"}
    assert settings.unknown(env) == ["RPCNB_SHMM"]
    wrong = settings.problems(env)
    assert any("RPCNB_SHMM is not a variable rpcnb reads" in w for w in wrong)
    assert any("RPCNB_CALL_TIMES='maybe' is not a yes or no" in w for w in wrong)
    report = dict(doctor.local_report(), settings=settings.set_now(env), settings_wrong=wrong)
    found = [f for f in doctor.findings({"worker1": report}) if f.check == "settings"]
    assert len(found) == 1 and found[0].level == "warn"
    assert "RPCNB_SHM=0" in found[0].detail and "RPCNB_SHMM" in found[0].todo


def test_the_settings_page_is_written_from_the_table():
    text = settings_table.SETTINGS_MD.read_text()
    assert settings_table.rendered(text) == text, settings_table.STALE.format(
        path=settings_table.SETTINGS_MD)
    for name in settings.SETTINGS:
        assert f"`{name}`" in text


def test_other_tools_variables_are_read_by_name_from_one_table():
    assert settings.other("TP_SOCKET_IFNAME", {"TP_SOCKET_IFNAME": "eth1"}) == "eth1"
    assert settings.other("CUDA_VISIBLE_DEVICES", {}) == ""
    env: dict[str, str] = {"GLOO_SOCKET_IFNAME": "eth0"}
    settings.set_default("GLOO_SOCKET_IFNAME", "lo", env)
    settings.set_default("NCCL_SOCKET_IFNAME", "lo", env)
    assert env == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "lo"}
    with pytest.raises(KeyError, match="BORROWED"):
        settings.other("TP_SOCKET_IFNAM")  # a typo is an error, not an empty value
    text = settings_table.SETTINGS_MD.read_text()
    for name in settings.BORROWED:
        assert f"| `{name}` |" in text
