"""``python -m prefixserve``: the same command as the ``prefixserve`` console script."""

import sys

from prefixserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
