"""Where messages send users (a docs URL and an offline command that prints the page), the
platform check, and the version. The command itself runs in tests/build/test_docs_command.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

import rpcnb
from rpcnb import docs, errors, machine

ROOT = Path(__file__).resolve().parents[2]


def test_messages_name_a_url_and_a_command_not_a_repository_path():
    import rpcnb.observe.doctor  # noqa: F401 - the modules whose messages name pages
    import rpcnb.sandbox.isolation as isolation
    import rpcnb.session.rendezvous as rendezvous

    for text in (errors.ENGINES_ELSEWHERE, isolation.NOTICE, rendezvous.REMOTE_EXPOSES):
        assert "docs/" not in text.replace(docs.SITE, ""), text
        assert docs.SITE in text and "python -m rpcnb.docs " in text, text
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert urls["Documentation"] == docs.SITE


@pytest.mark.parametrize("platform", ["darwin", "win32", "cygwin"])
def test_other_platforms_get_one_clear_sentence(platform):
    with pytest.raises(machine.UnsupportedPlatform) as err:
        machine.check_platform(platform)
    assert isinstance(err.value, ImportError)
    said = str(err.value)
    assert f"runs on Linux only, and this is {platform!r}" in said
    assert "WSL 2" in said and docs.url("getting-started", "platforms") in said
    machine.check_platform("linux")  # and Linux passes


def test_one_version_number():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert rpcnb.__version__ == declared
    assert f"## {declared}" in (ROOT / "CHANGELOG.md").read_text()
