"""The panel's actions as one table (rpcnb/frontend/panel_actions.py), checked without a
kernel: every action the publisher holds back for a running cell is in the table, and the
answers to what the panel cannot ask come before anything is started or asked
(tests/kernel/test_panel.py drives the actions through a real kernel's comm)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from rpcnb.frontend import panel, panel_actions


class Notebook:
    """The panel as an action sees it: a namespace, and no RRef it described."""

    def __init__(self) -> None:
        self.shell = SimpleNamespace(user_ns={})
        self.forgotten: list[str] = []

    def size_of(self, key: str) -> int:
        return 0

    def forget(self, key: str) -> None:
        self.forgotten.append(key)


def test_every_action_that_waits_for_the_running_cell_is_in_the_table():
    assert panel.WAIT_FOR_IDLE <= set(panel_actions.ACTIONS)


@pytest.mark.parametrize("action", ["nothing", "", "Start"])
def test_an_unknown_action_is_answered_with_what_to_do(action: str):
    with pytest.raises(ValueError) as err:
        panel_actions.act(Notebook(), action, {})
    assert str(err.value) == panel_actions.UNKNOWN_ACTION.format(action=action)


def test_an_unknown_widget_is_an_unknown_action():
    with pytest.raises(ValueError) as err:
        panel_actions.act(Notebook(), "open", {"what": "nothing"})
    assert str(err.value) == panel_actions.UNKNOWN_ACTION.format(action="open nothing")


@pytest.mark.parametrize(("action", "data", "message"), [
    ("start", {"workers": 65}, panel_actions.BAD_WORKERS.format(value=65)),
    ("start", {"workers": "two"}, panel_actions.BAD_WORKERS.format(value="two")),
    ("start", {"workers": True}, panel_actions.BAD_WORKERS.format(value=True)),
    ("add", {"n": 0}, panel_actions.BAD_ADD.format(value=0)),
    ("add", {"n": "0"}, panel_actions.BAD_ADD.format(value=0)),
    ("fetch", {"name": "1x", "key": "k"}, panel_actions.BAD_VARIABLE.format(name="1x")),
    ("fetch", {"name": "class", "key": "k"}, panel_actions.BAD_VARIABLE.format(name="class")),
    ("fetch", {"name": "x", "key": "k"}, panel_actions.GONE),
])
def test_what_the_panel_cannot_ask_is_refused_before_anything_runs(
        action: str, data: dict[str, Any], message: str):
    notebook = Notebook()
    with pytest.raises(ValueError) as err:
        panel_actions.act(notebook, action, data)
    assert str(err.value) == message
    assert notebook.shell.user_ns == {} and notebook.forgotten == []
