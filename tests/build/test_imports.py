"""What importing a module costs a fresh interpreter: the device-map model imports no torch
(so the device-map editor and %rpc_devmap work before torch is loaded). One Python
process per check; the model itself is tested in tests/unit/test_devicemap.py."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_device_map_module_does_not_import_torch():
    code = "import sys, rpcnb.wire.devicemap; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
