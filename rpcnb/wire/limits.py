"""Time limits that grow with what a call carries: the group's RPC timeout (``%rpc_init
--timeout``, 60 s by default) for the call itself, plus one second per ``floor_rate()``
bytes of its payload (1 MB/s unless ``RPCNB_MIN_RATE`` says otherwise: slower than any
link a group is expected to run over, a 20 ms, 1 %-loss link included).

So a small call to a member that stopped answering still fails after the group's timeout
(and a partition is told within seconds, ``rpcnb.membership.failures``), while a 1 GB
tensor over a slow link gets 60 s + 17 min instead of being cut off at 60 s. A limit the
caller gives torch itself (``rpc_sync(..., timeout=30)``) is kept as given; no limit
(``timeout=0``) stays none.

Nothing here talks to other members or imports torch.
"""

from __future__ import annotations

from rpcnb import settings

MIN_RATE_ENV = "RPCNB_MIN_RATE"  # bytes per second a payload's time limit assumes
DEFAULT_MIN_RATE = float(settings.SETTINGS[MIN_RATE_ENV].default)  # 1 MB/s
GROW_FROM = 1 << 20  # bytes from which a plain call's limit grows (1 s at the floor rate)


def floor_rate() -> float:
    """Bytes per second every payload is assumed to reach at least (``RPCNB_MIN_RATE``, read
    now: only a call that carries a payload asks, and a read takes a microsecond)."""
    return float(settings.number(MIN_RATE_ENV))


def grown(base: float, nbytes: int) -> float:
    """The time limit of a call whose own limit is ``base`` seconds and which carries
    ``nbytes`` bytes: ``base + nbytes / floor_rate()``; ``base`` 0 (no limit) stays 0."""
    if base <= 0 or nbytes <= 0:
        return base
    return base + nbytes / floor_rate()

