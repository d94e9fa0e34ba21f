"""``python -m rpcnb.docs [PAGE]``: print a page of rpcnb's documentation, or list them."""

import sys

from rpcnb.docs import main

if __name__ == "__main__":  # (importing every module, as a test does, runs nothing)
    sys.exit(main())
