"""``python -m tandem ...``: the ``tandem`` command."""

import sys

from tandem.cli import main

sys.exit(main())
