"""`python -m anchorkv.demo [ARGS]`: the same as `anchorkv demo [ARGS]`."""

import sys

from anchorkv.cli import main

sys.exit(main(["demo", *sys.argv[1:]]))
