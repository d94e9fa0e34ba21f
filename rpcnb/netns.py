"""``python -m rpcnb.netns run -- CMD | hold DIR | status``: the user's private network
namespace, as the `rpcnb` kernelspec and docs/security.md name it; the code is
``rpcnb.sandbox.netns``."""

from __future__ import annotations

if __name__ == "__main__":
    import sys

    from rpcnb.sandbox.netns import main

    sys.exit(main())
