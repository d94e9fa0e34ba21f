"""A slow, lossy link between two TAP devices, for kernels without ``sch_netem`` (``tc
qdisc add ... netem`` answers "Specified qdisc kind is unknown"): this process holds both
devices and carries every Ethernet frame from one to the other after ``--delay`` seconds,
dropping each with probability ``--loss``, at ``--rate`` bytes per second at most (a FIFO
queue of ``--queue`` seconds, its tail dropped when full, as a router's). Each direction
is delayed, lost and limited on its own, as ``netem`` on both ends of a veth pair.

    python linkemu.py TAP_A TAP_B [--delay S] [--loss P] [--rate B/S]

It prints "ready" once both devices exist; the devices go when the process ends (the test
moves TAP_B into the other namespace and stops this process by pid)."""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import random
import select
import struct
import sys
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


def pump(src: int, dst: int, delay: float, loss: float, rate: float, queue_s: float,
         seed: int) -> None:
    rng = random.Random(seed)
    due: collections.deque[tuple[float, bytes]] = collections.deque()
    free_at = 0.0  # when the rate limiter has sent what is queued
    while True:
        now = time.monotonic()
        wait = max(0.0, due[0][0] - now) if due else 1.0
        ready, _, _ = select.select([src], [], [], wait)
        if ready:
            while True:
                try:
                    frame = os.read(src, 65536)
                except BlockingIOError:
                    break
                now = time.monotonic()
                if rate > 0:
                    if free_at - now > queue_s:  # the queue is full: its tail is dropped
                        continue
                    free_at = max(now, free_at) + len(frame) / rate
                    leaves = free_at
                else:
                    leaves = now
                if rng.random() < loss:
                    continue
                due.append((leaves + delay, frame))
        now = time.monotonic()
        while due and due[0][0] <= now:
            try:
                os.write(dst, due.popleft()[1])
            except OSError:  # the device is down (a test cut the link): the frame is lost
                pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--delay", type=float, default=0.02)
    ap.add_argument("--loss", type=float, default=0.01)
    ap.add_argument("--rate", type=float, default=0.0, help="bytes per second; 0: no limit")
    ap.add_argument("--queue", type=float, default=0.2, help="seconds of frames queued at most")
    args = ap.parse_args()
    a, b = open_tap(args.a), open_tap(args.b)
    for i, (src, dst) in enumerate(((a, b), (b, a))):
        threading.Thread(target=pump, args=(src, dst, args.delay, args.loss, args.rate,
                                            args.queue, 1000 + i), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    sys.exit(main())
