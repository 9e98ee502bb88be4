"""``python -m hrockmate``: the same command line as ``hrockmate``."""

import sys

from hrockmate.cli import main

sys.exit(main())
