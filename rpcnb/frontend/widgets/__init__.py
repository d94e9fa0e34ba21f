"""rpcnb's notebook widgets (anywidget): the channel monitor, the device-map editor and
the doctor's report.

Each widget is one small Python class with synced traits and one hand-written ES module
beside it (after the helpers of ``dom.js``, which ``dom.esm`` puts in front). Importing this
package imports neither anywidget nor torch; the classes load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rpcnb.wire.options import applied_device_map, keep_device_map

if TYPE_CHECKING:
    from rpcnb.frontend.widgets.channel_monitor import ChannelMonitor
    from rpcnb.frontend.widgets.devmap_editor import DeviceMapEditor
    from rpcnb.frontend.widgets.doctor_report import DoctorReport

__all__ = [
    "NEEDS_ANYWIDGET",
    "ChannelMonitor",
    "DeviceMapEditor",
    "DoctorReport",
    "applied_device_map",
    "keep_device_map",
]

NEEDS_ANYWIDGET = (
    "This widget needs anywidget and ipywidgets: pip install anywidget ipywidgets, "
    "then restart the kernel."
)


def __getattr__(name: str) -> Any:
    if name == "ChannelMonitor":
        from rpcnb.frontend.widgets.channel_monitor import ChannelMonitor

        return ChannelMonitor
    if name == "DeviceMapEditor":
        from rpcnb.frontend.widgets.devmap_editor import DeviceMapEditor

        return DeviceMapEditor
    if name == "DoctorReport":
        from rpcnb.frontend.widgets.doctor_report import DoctorReport

        return DoctorReport
    raise AttributeError(name)
