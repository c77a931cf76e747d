"""``python -m mlx_dflash2.server``."""

import sys

from .cli import main

sys.exit(main())
