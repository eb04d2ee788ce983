"""`python -m launcher.compare`."""

import sys

from launcher.compare.compare import main

sys.exit(main())
