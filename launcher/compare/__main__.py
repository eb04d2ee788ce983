"""`python -m launcher.compare`."""

import sys

from launcher.compare.cli import main

sys.exit(main())
