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


DIGEST = ("import hashlib, os\n"
          "def digest(t):\n"
          "    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()\n"
          "def digest_bytes(b):\n"
          "    return hashlib.sha256(b).hexdigest()\n")


def test_data_arrives_intact_over_a_slow_lossy_link(kernel, tmp_path):
    """24 MB of random values pushed, fetched back, and sent by rpc_sync (a Python
    function, a builtin and back, raw bytes) have the same SHA-256 on both sides; an 8 MB
    printout arrives whole; a 114 MB push shows its bar and its rate."""
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
            out, took = timed(kernel, "blob = os.urandom(24 << 20)\n"
                                      "rpc.rpc_sync('worker2', digest_bytes, args=(blob,)) == "
                                      "digest_bytes(blob)", timeout=300)
            assert out.text == "True", (out.text, out.traceback)
            print(f"rpc_sync with 24 MB of random bytes: {took:.1f} s")
            out, took = timed(kernel, "%%remote worker2\nprint('0123456789abcdef' * (1 << 19))",
                              timeout=300)
            assert out.stdout == "0123456789abcdef" * (1 << 19) + "\n", len(out.stdout)
            print(f"8 MB printed on worker2: {took:.1f} s")

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


def test_time_limits_grow_with_what_is_sent(kernel, tmp_path):
    """A group whose RPC timeout is 2 s, over a link of 2.5 MB/s (20 Mbit/s) with 20 ms
    delay and 1 % loss: a 10 MB argument and a 10 MB printout take longer than 2 s and
    arrive, because their time limits grow with their size (2 s + 1 s per MB); a 10 MB
    --push and an 8 MB --fetch (no limit) arrive and show their bars; a small call to a
    member that does not answer in 2 s still fails after 2 s; and the same 10 MB under a
    fixed 2 s limit (``timeout=2``, as every call had before) is cut off."""
    tag = os.getpid() % 100000 + 1
    base = 2
    with slow_link(*net_for(tag), delay=0.02, loss=0.01, rate=2.5e6) as net:
        procs, _ = far_group(kernel, net, tmp_path, names=("worker2",), own_pids=True,
                             init=f"--timeout {base}", worker_args=("--timeout", str(base)))
        try:
            print(f"link: {net['how']}, 20 ms and 1 % loss each way, 20 Mbit/s")
            assert kernel.value("__import__('torch').distributed.rpc.get_rpc_timeout()") == base
            n = 10 * MB // 4
            kernel.execute(f"import torch, time\nimport torch.distributed.rpc as rpc\n{DIGEST}"
                           f"torch.manual_seed(31)\nx = torch.randn({n})\nwant = digest(x)")
            kernel.execute(f"%%remote worker2\n{DIGEST}")

            # a plain call with a 10 MB argument: longer than the group's timeout, and it
            # arrives (its limit: 2 s + 10 s)
            out, took = timed(kernel, "rpc.rpc_sync('worker2', digest, args=(x,)) == want",
                              timeout=120)
            assert out.text == "True", (out.text, out.traceback)
            assert took > base, took
            print(f"rpc_sync with 10 MB: {took:.1f} s (limit {base} s before, "
                  f"{base + 10} s now)")

            # --push and --fetch have no limit; across hosts, a bar from 8 MB once they
            # have taken half a second
            out, took = timed(kernel, "%%remote worker2 --push x --fetch\ndigest(x)",
                              timeout=120)
            assert not out.error, out.traceback
            assert out.text.strip("'") == kernel.value("want")
            assert took > base, took
            text = shown(out)
            assert "--push to worker2: 10.0 MB" in text and "/s" in text, text
            print(f"--push of 10 MB: {took:.1f} s, with a progress bar")
            out, took = timed(kernel, "%%remote worker2 --fetch -o part\nx[:2 << 20]",
                              timeout=120)
            assert not out.error, out.traceback
            assert kernel.value("torch.equal(part, x[:2 << 20])")
            text = shown(out)
            assert "--fetch from worker2: 8.0 MB" in text and "/s" in text, text
            print(f"--fetch of 8 MB: {took:.1f} s, with a progress bar")

            # output: a cell that prints 10 MB; each batch's delivery has its own limit
            line = "0123456789abcdef" * 64  # 1 KB a line
            out, took = timed(kernel, f"%%remote worker2\nprint('\\n'.join([{line!r}] * 10240))",
                              timeout=120)
            assert not out.error, out.traceback
            assert out.stdout.count(line) == 10240, len(out.stdout)
            assert took > base, took
            print(f"10 MB printed on worker2: {took:.1f} s")

            # a small call still fails after the group's timeout
            out, took = timed(kernel, "rpc.rpc_sync('worker2', time.sleep, args=(3 * "
                                      f"{base},))", timeout=60)
            assert out.error and "more than set timeout" in out.traceback, out.traceback
            assert base - 0.5 < took < base + 3, took
            print(f"a small call that gets no answer failed after {took:.1f} s")

            # what a fixed limit did to the 10 MB
            out, took = timed(kernel, f"rpc.rpc_sync('worker2', digest, args=(x,), "
                                      f"timeout={base})", timeout=120)
            assert out.error and "more than set timeout" in out.traceback, out.traceback
            print(f"the same 10 MB under a fixed {base} s limit: cut off after {took:.1f} s")
            kernel.execute("%rpc_shutdown", timeout=60)
        finally:
            stop(procs, net["ns"])
