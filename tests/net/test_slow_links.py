"""Slow, lossy links between hosts: the notebook's kernel (worker0) and a spawned worker1
here, a headless worker2 on a second "host" (a network namespace with a hostname of its
own, tests/net/hosts.py) behind a link that delays every frame 20 ms and loses 1 % of
them each way (``tc netem``; where the kernel has no netem, a user-space link with the
same delay and loss, tests/net/linkemu.py). What is sent arrives intact, time limits grow
with what is sent, and a long transfer shows its progress. Real kernel, real workers,
real TensorPipe; skipped with the reason where root, network namespaces or a way to slow
a link are missing. Every process is stopped by pid."""

from __future__ import annotations

import os

from hosts import far_group, slow_link, stop, timed

MB = 1 << 20


def net_for(tag: int) -> tuple[str, str, str]:
    return f"rpcnb-s{tag}", f"rps{tag}", f"10.214.{tag % 250}"


def shown(out) -> str:
    """Everything a cell showed: its text and its displays' (a bar is a display)."""
    parts = [out.stdout, out.stderr]
    for d in out.displays:
        parts.append(d.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


DIGEST = ("import hashlib\n"
          "def digest(t):\n"
          "    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()\n")


def test_data_arrives_intact_over_a_slow_lossy_link(kernel, tmp_path):
    tag = os.getpid() % 100000
    with slow_link(*net_for(tag), delay=0.02, loss=0.01) as net:
        procs, _ = far_group(kernel, net, tmp_path, names=("worker2",), own_pids=True)
        try:
            print(f"link: {net['how']}, 20 ms each way, 1 % loss each way")
            n = 24 * MB // 4
            kernel.execute(f"import torch, time\nimport torch.distributed.rpc as rpc\n{DIGEST}"
                           f"torch.manual_seed(30)\nx = torch.randn({n})\nwant = digest(x)")
            kernel.execute(f"%%remote worker2\n{DIGEST}")
            out, took = timed(kernel, "%%remote worker2 --push x --fetch\ndigest(x)", timeout=300)
            assert not out.error, out.traceback
            assert out.text.strip("'") == kernel.value("want")
            print(f"--push of {n * 4 / MB:.0f} MB: {took:.1f} s")
            out, took = timed(kernel, "%%remote worker2 --fetch -o back\nx", timeout=300)
            assert not out.error, out.traceback
            assert kernel.value("digest(back) == want and torch.equal(back, x)")
            print(f"--fetch of {n * 4 / MB:.0f} MB: {took:.1f} s")
            out, took = timed(kernel, "got = rpc.rpc_sync('worker2', digest, args=(x,))\n"
                                      "got == want", timeout=300)
            assert out.text == "True", (out.text, out.traceback)
            print(f"rpc_sync with a {n * 4 / MB:.0f} MB argument: {took:.1f} s")
            out, took = timed(kernel, "y = rpc.rpc_sync('worker2', torch.add, args=(x, 0))\n"
                                      "torch.equal(y, x)", timeout=300)
            assert out.text == "True", (out.text, out.traceback)
            print(f"rpc_sync of a builtin, {n * 4 / MB:.0f} MB there and back: {took:.1f} s")

            # a long push shows its bar (after RPCNB_PROGRESS_DELAY s), then its rate
            kernel.execute("big = torch.randn(30_000_000)\nwant_big = digest(big)")  # 114 MB
            out, took = timed(kernel, "%%remote worker2 --push big --fetch\ndigest(big)",
                              timeout=300)
            assert not out.error, out.traceback
            assert out.text.strip("'") == kernel.value("want_big")
            text = shown(out)
            assert "--push to worker2: 114.4 MB" in text, text
            assert "/s" in text, text  # its last update says the rate
            print(f"--push of 114 MB: {took:.1f} s, with a progress bar")
            kernel.execute("%rpc_shutdown", timeout=60)
        finally:
            stop(procs, net["ns"])
