"""A build hook of hatchling's: a wheel (or an editable install) of rpcnb carries the
prebuilt JupyterLab extension (labextension/build, shared data in
share/jupyter/labextensions/rpcnb); without it the build stops and says how to make it,
rather than install an rpcnb whose JupyterLab panel is silently missing."""

from __future__ import annotations

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

NOT_BUILT = (
    "rpcnb's JupyterLab extension is not built (labextension/build/package.json is "
    "missing): run `make labextension` (needs Node.js and JupyterLab's jlpm; `make .venv` "
    "does it all) before building or installing rpcnb."
)


class LabExtensionHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if not (Path(self.root) / "labextension" / "build" / "package.json").is_file():
            raise RuntimeError(NOT_BUILT)
