"""`python -m bistouri.symbolizer.service symbolizer|symbolize ...`: the symbolizer's commands alone."""

import sys

from .cli import main

sys.exit(main())
