"""`python -m launcher.tune`."""

import sys

from launcher.tune.tuner import main

sys.exit(main())
