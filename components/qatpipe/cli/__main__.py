"""`python -m qatpipe.cli` (Horovod's launcher re-runs a command this way)."""

import sys

from qatpipe.cli import main

sys.exit(main())
