"""`python -m launcher.tune`."""

import sys

from launcher.core.children import exit_without_teardown
from launcher.core.logs import route_library_logs

route_library_logs()  # before deepspeed is imported: its "Setting accelerator to CPU" is noise here

from launcher.tune.tuner import main  # noqa: E402

with exit_without_teardown():  # its end without the interpreter's teardown (launcher.core.children)
    sys.exit(main())
