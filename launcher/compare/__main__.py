"""`python -m launcher.compare`."""

import sys

from launcher.compare.cli import main
from launcher.core.children import exit_without_teardown

with exit_without_teardown():  # its end without the interpreter's teardown (launcher.core.children)
    sys.exit(main())
