"""`python -m bistouri.symbolizer symbolizer|symbolize ...`: the symbolizer's commands on their own."""

import sys

from .cli import main

sys.exit(main())
