"""The doctor's report as a widget: ``%rpc_doctor``'s findings grouped by member, problems
first, each with what to do, and a button that checks the group again.

The findings are ``rpcnb.observe.doctor``'s, unchanged; the plain-text form of the widget (what a
terminal, ``nbconvert`` or a front end without widgets shows) is ``doctor.describe``'s
text, the one ``%rpc_doctor --text`` prints.
"""

from __future__ import annotations

import time
from typing import Any

import anywidget
import traitlets

from rpcnb.frontend.widgets.dom import esm
from rpcnb.membership import kept
from rpcnb.observe import doctor

CHECK_FAILED = "the check failed: {reason}"


class DoctorReport(anywidget.AnyWidget):
    """``DoctorReport()`` checks the group (and the user's kept groups) now;
    ``DoctorReport(found)`` shows findings that ``rpcnb.observe.doctor.check()`` (and
    ``rpcnb.membership.kept.findings()``) returned; ``%rpc_doctor``."""

    _esm = esm("doctor_report.js")

    me = traitlets.Unicode("").tag(sync=True)
    # [{member, check, level ("ok", "note", "warn"), detail, todo}], doctor.check()'s order
    findings = traitlets.List(traitlets.Dict()).tag(sync=True)
    checked = traitlets.Float(0.0).tag(sync=True)  # when (seconds, epoch)
    status = traitlets.Unicode("").tag(sync=True)  # "" or why the last check failed

    def __init__(self, found: list[doctor.Finding] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from rpcnb.session import state

        self.me = state.current().name
        self._found: list[doctor.Finding] = []
        if found is None:
            self.check()
        else:
            self._show(found)
        self.on_msg(self._on_msg)

    def _show(self, found: list[doctor.Finding]) -> None:
        self._found = list(found)
        with self.hold_sync():
            self.findings = doctor.to_json(self._found)
            self.checked = time.time()
            self.status = ""

    def check(self) -> list[doctor.Finding]:
        """Ask every member again; the widget shows the new findings (or why it could not)."""
        self.status = ""  # a second failure for the same reason is a change the page sees
        try:
            found = doctor.check() + kept.findings()
        except Exception as exc:  # the group ended, a member did not answer
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            self.status = CHECK_FAILED.format(reason=reason)
            raise
        self._show(found)
        return found

    @property
    def problems(self) -> list[doctor.Finding]:
        return [f for f in self._found if f.level == "warn"]

    def __repr__(self) -> str:
        return doctor.describe(self._found)

    def _on_msg(self, widget: Any, content: Any, buffers: Any) -> None:
        if isinstance(content, dict) and content.get("event") == "check":
            try:
                self.check()
            except Exception:
                pass  # status says why
