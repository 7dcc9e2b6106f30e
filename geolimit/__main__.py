"""``python -m geolimit``: the same as the ``geolimit`` command."""

import sys

from geolimit.cli import main

sys.exit(main())
