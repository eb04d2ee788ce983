"""`python -m launcher.prepare`: a job's data prepared before the job (launcher.prepare.prepare)."""

import sys

from launcher.prepare.prepare import main

sys.exit(main())
