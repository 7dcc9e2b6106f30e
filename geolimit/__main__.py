"""``python -m geolimit``: the same as the ``geolimit`` command."""

import os
import sys

if getattr(sys.modules.get("geolimit"), "__file__", None) is None:
    # Run from a directory holding the clone (``./geolimit/geolimit/...``): the clone's root
    # was imported as a namespace package named ``geolimit``. Import the real package instead.
    for name in [m for m in sys.modules if m == "geolimit" or m.startswith("geolimit.")]:
        del sys.modules[name]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from geolimit.cli import main

sys.exit(main())
