"""`python -m launcher.plan`."""

import sys

from launcher.plan.report import main

sys.exit(main())
