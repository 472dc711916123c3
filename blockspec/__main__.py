"""`python -m blockspec`: the `blockspec` command line."""

import sys

from blockspec.cli import main

sys.exit(main())
