"""``python -m daskdag.cli``: the ``daskdag`` command."""

import sys

from daskdag.cli import main

if __name__ == "__main__":
    sys.exit(main())
