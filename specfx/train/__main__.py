"""``python -m specfx.train``: the same as ``specfx train``."""

import sys

from specfx.train import main

sys.exit(main())
