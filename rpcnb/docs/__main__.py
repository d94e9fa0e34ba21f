"""``python -m rpcnb.docs [PAGE]``: print a page of rpcnb's documentation, or list them."""

import sys

from rpcnb.docs import main

sys.exit(main())
