import sys

from anchorkv.cli import main

sys.exit(main())
