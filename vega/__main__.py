"""``python -m vega``: the ``vega`` command, for an environment whose scripts directory is
not on ``PATH``."""
import sys

from vega.cli import main

sys.exit(main())
