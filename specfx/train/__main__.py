"""``python -m specfx.train``: the same as ``specfx train``."""

import sys

from . import main

sys.exit(main())
