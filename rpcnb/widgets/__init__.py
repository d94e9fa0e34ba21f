"""rpcnb's notebook widgets (anywidget): the channel monitor and the device-map editor.

Each widget is one small Python class with synced traits and one hand-written ES module
beside it. Importing this package imports neither anywidget nor torch; the classes load
on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rpcnb.widgets.channel_monitor import ChannelMonitor
    from rpcnb.widgets.devmap_editor import DeviceMapEditor

__all__ = [
    "NEEDS_ANYWIDGET",
    "ChannelMonitor",
    "DeviceMapEditor",
    "applied_device_map",
    "keep_device_map",
]

NEEDS_ANYWIDGET = (
    "This widget needs anywidget and ipywidgets: pip install anywidget ipywidgets, "
    "then restart the kernel."
)


_applied: dict[str, Any] | None = None


def keep_device_map(device_map: dict[str, Any] | None) -> None:
    """Keep ``device_map`` (dict form) for this kernel's next ``%rpc_init`` / ``--join``."""
    global _applied
    _applied = dict(device_map) if device_map else None


def applied_device_map() -> dict[str, Any] | None:
    """The map the device-map editor applied, or None."""
    return dict(_applied) if _applied else None


def __getattr__(name: str) -> Any:
    if name == "ChannelMonitor":
        from rpcnb.widgets.channel_monitor import ChannelMonitor

        return ChannelMonitor
    if name == "DeviceMapEditor":
        from rpcnb.widgets.devmap_editor import DeviceMapEditor

        return DeviceMapEditor
    raise AttributeError(name)
