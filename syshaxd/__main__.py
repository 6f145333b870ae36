"""`python -m syshaxd` runs the daemon, like the `syshaxd` command."""

import sys

from syshaxd.daemon import main

if __name__ == "__main__":
    sys.exit(main())
