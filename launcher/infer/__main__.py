import sys

from launcher.infer.infer import main

sys.exit(main())
