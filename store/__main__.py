"""`python -m store …` is `kvledger store …` (the projector), for running it as a plain process."""

import sys

from kvledger.cli import main

raise SystemExit(main(["store", *sys.argv[1:]]))
