"""`python -m syshaxd.benchmark ...`: the benchmark without the syshax CLI around it."""

import sys

from . import main

sys.exit(main())
