"""``python -m zephon``: the command line."""

import sys

from zephon.cli import main

sys.exit(main())
