"""``python -m zload ...``: the same command line as the ``zload`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
