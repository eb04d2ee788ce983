"""`python -m launcher.export`."""

import sys

from launcher.export.export import main

sys.exit(main())
