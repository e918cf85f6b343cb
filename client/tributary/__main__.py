"""``python -m tributary``: see ``tributary.cli``."""

import sys

from tributary.cli import main

sys.exit(main())
