"""``python -m daskdag.cli``: the ``daskdag`` command."""

import sys

from daskdag.cli.commands import main

sys.exit(main())
