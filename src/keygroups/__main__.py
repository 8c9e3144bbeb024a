"""``python -m keygroups``: the same as the ``keygroups`` command."""

import sys

from keygroups.cli import main

sys.exit(main())
