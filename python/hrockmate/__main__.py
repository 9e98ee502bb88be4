"""``python -m hrockmate``: the same command line as ``hrockmate``."""

import sys

try:
    from hrockmate.cli import main

    status = main()
except KeyboardInterrupt:  # Ctrl-C before the command started (imports, argument parsing)
    print("hrockmate: interrupted", file=sys.stderr)
    status = 130
sys.exit(status)
